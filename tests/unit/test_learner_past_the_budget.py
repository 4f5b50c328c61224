"""A learner with no checkpoint of its own takes the run's schedule position when it joins; once the run is past the
budget it has nothing left to train. What it reports then: its status at the budget (not the position beyond it),
and summary.json the inner steps its processes trained (its steps before a crash), not the position it took."""

from __future__ import annotations

import json

import torch

import ddiloco
from ddiloco.runtime.report import build_summary
from ddiloco.runtime.report_table import summary_table
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import TinyNet
from tests.runtime_dir import write_json, write_jsonl

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def test_a_learner_joining_past_the_budget_is_done_at_once_and_its_status_says_the_budget(tmp_path):
    shared = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    ahead = TinyNet(seed=1)
    with ddiloco.session(ahead, torch.optim.SGD(ahead.parameters(), lr=0.1), hub=shared, learner_id=0,
                         inner_steps=16) as sync:
        while not sync.done:
            sync.step(tokens=4)
    late = TinyNet(seed=1)
    with ddiloco.session(late, torch.optim.SGD(late.parameters(), lr=0.1), hub=shared, learner_id=1, inner_steps=8,
                         run_dir=tmp_path) as sync:
        assert sync.done and sync.inner_step > 8  # the run's position: past this learner's budget
    status = json.loads((tmp_path / "learners" / "1" / "status.json").read_text())
    assert (status["state"], status["inner_step"], status["inner_steps"]) == ("done", 8, 8)


def restarted_past_the_budget(root) -> RunPaths:
    """Learner 0 of a 150-step run: its first process trained 40 steps and failed (no checkpoint); the next took the
    run's position, 163, and was done at once. Learner 1 trained its 150 steps in one process, killed at none."""
    paths = RunPaths(root)
    write_jsonl(paths.learner_metrics(0), [{"step": n, "time": 100.0 + n, "learner/0/tokens": 64 * n}
                                           for n in range(1, 41)])
    write_jsonl(paths.learner_dir(0) / "work.jsonl", [
        {"event": "start", "time": 100.0, "inner_step": 0},
        {"event": "welcome", "time": 100.5, "inner_step": 0},
        {"event": "publish", "time": 136.0, "fragment": 0, "inner_step": 36},
        {"event": "end", "time": 140.5, "inner_step": 40, "state": "failed"},
        {"event": "start", "time": 160.0, "inner_step": 0},
        {"event": "position", "time": 160.1, "inner_step": 163, "next_round": 40},
        {"event": "welcome", "time": 160.2, "inner_step": 163},
        {"event": "end", "time": 160.3, "inner_step": 163, "state": "done"},
    ])
    write_json(paths.learner_status(0), {"state": "done", "inner_step": 163, "inner_steps": 150, "tokens": 0})
    write_jsonl(paths.learner_metrics(1), [{"step": n, "time": 100.0 + n, "learner/1/tokens": 64 * n}
                                           for n in range(1, 151)])
    write_jsonl(paths.learner_dir(1) / "work.jsonl", [
        {"event": "start", "time": 100.0, "inner_step": 0},
        {"event": "publish", "time": 248.0, "fragment": 1, "inner_step": 148},  # a kill -9 after step 150: the
    ])                                                                          # metrics say how far it got
    write_json(paths.learner_status(1), {"state": "done", "inner_step": 150, "inner_steps": 150, "tokens": 9600})
    return paths


def test_the_summary_caps_the_position_at_the_budget_and_counts_the_steps_trained(tmp_path):
    # summary.json said inner_step 163 of a budget of 150, tokens 0, for a learner whose only training was 40 steps
    # before its crash.
    paths = restarted_past_the_budget(tmp_path / "run")
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=1.0)
    zero, one = summary["learners"]["0"], summary["learners"]["1"]
    assert (zero["inner_step"], zero["inner_steps_trained"]) == (150, 40)
    assert (one["inner_step"], one["inner_steps_trained"]) == (150, 150)
    rows = {row.split()[0]: row for row in summary_table_text(summary).splitlines() if row.split()[:1] in (["0"],
                                                                                                            ["1"])}
    assert "150 (40 trained)" in rows["0"] and "trained" not in rows["1"]


def summary_table_text(summary) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    return console.export_text().replace("│", " ")


def test_a_learner_resumed_from_its_own_checkpoint_past_a_smaller_budget_reports_its_checkpoints_step(tmp_path):
    # `ddiloco run --resume RUN --inner-steps 30` of a run whose learners trained to 60: status.json and summary.json
    # said inner_step 30, a step the learner never stopped at; its checkpoint holds 60.
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    for budget in (16, 8):
        model = TinyNet(seed=1)
        with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub, learner_id=0,
                             inner_steps=budget, run_dir=tmp_path) as sync:
            while not sync.done:
                sync.step(tokens=4)
        assert sync.inner_step == 16
    status = json.loads((tmp_path / "learners" / "0" / "status.json").read_text())
    assert (status["state"], status["inner_step"], status["inner_steps"], status["checkpoint_inner_step"]) == (
        "done", 16, 8, 16)
    summary = build_summary(RunPaths(tmp_path), num_learners=1, outcome="completed", wall_time_s=1.0)
    assert summary["learners"]["0"]["inner_step"] == 16
