"""The files a run writes for tools (metrics, status files, the summary) are strict JSON: a NaN or an infinity from a
user's `evaluate` or loss is written as null. Python's json wrote the bare words NaN and Infinity, which jq,
JavaScript's JSON.parse and most other readers refuse. A checkpoint's state keeps them: it is read back by Python,
and must come back as it was."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ddiloco.checkpoint import atomic_write_json, load_latest_state, save_state
from ddiloco.evaluator import Watcher
from ddiloco.learner_stats import LearnerStats
from ddiloco.learner_status import COUNTERS, StatusReporter
from ddiloco.messages import FragmentState, Welcome
from ddiloco.metrics import JsonlSink, NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.report import write_report
from ddiloco.runtime.run_paths import RunPaths


def strict_load(text: str):
    """json.loads as a strict reader does it: NaN, Infinity and -Infinity are not JSON."""
    def refuse(word: str):
        raise ValueError(f"not JSON: {word}")
    return json.loads(text, parse_constant=refuse)


def strict_lines(path: Path) -> list[dict]:
    return [strict_load(line) for line in path.read_text().splitlines()]


def test_an_evaluator_metric_that_is_not_finite_is_written_as_null(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))  # 4 tensors: one per fragment of the default config
    watcher = Watcher(model, lambda m: {"val_loss": float("nan"), "ppl": math.inf, "acc": 0.5},
                      address="127.0.0.1:1", config=RunConfig(), run_dir=tmp_path)
    welcome = Welcome(learner_id=-1, config_fingerprint="", fragments=(FragmentState(
        fragment=0, version=3, tensors={n: p.detach().clone() for n, p in model.named_parameters()}),))
    try:
        with caplog.at_level(logging.WARNING):
            watcher._evaluate(welcome)
            watcher._evaluate(welcome)
    finally:
        watcher.sink.close()
        watcher.client.close()
    lines = strict_lines(tmp_path / "evaluator" / "metrics.jsonl")
    assert [(r["eval/val_loss"], r["eval/ppl"], r["eval/acc"]) for r in lines] == [(None, None, 0.5)] * 2
    status = strict_load((tmp_path / "evaluator" / "status.json").read_text())
    assert status["metrics"] == {"val_loss": None, "ppl": None, "acc": 0.5} and status["val_loss"] is None
    # Said once per file, not at every line.
    assert sum("written as null" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_a_learner_status_with_a_nan_loss_is_strict_json(tmp_path):
    learner = SimpleNamespace(learner_id=0, inner_step=5, versions=[1, 2], stats=LearnerStats())
    transport = SimpleNamespace(connected=True, counters=lambda: {
        name: 0 for name in COUNTERS if name not in ("updates_sent", "fragments_applied", "waits_abandoned",
                                                     "non_finite_recoveries", "publishes_waited")})
    reporter = StatusReporter(learner, transport, inner_steps=10, directory=tmp_path, every_s=1.0, sink=NullSink(),
                              prefix="learner/0")
    reporter.set(state="training", loss=float("nan"))
    reporter.write()
    assert strict_load((tmp_path / "status.json").read_text())["loss"] is None


def test_a_learners_metrics_with_a_nan_loss_are_strict_json(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log({"learner/0/loss": float("nan"), "learner/0/tokens": 8}, step=1)
    sink.log({"learner/0/loss": -math.inf, "nested": [1.0, math.nan]}, step=2)
    sink.close()
    lines = strict_lines(tmp_path / "metrics.jsonl")
    assert [r["learner/0/loss"] for r in lines] == [None, None] and lines[1]["nested"] == [1.0, None]


def test_the_summary_of_a_run_whose_last_validation_loss_is_nan_is_strict_json(tmp_path):
    """Files written before this fix (bare NaN) are read, and the report written from them is strict."""
    paths = RunPaths(tmp_path / "run")
    paths.evaluator_metrics.parent.mkdir(parents=True)
    paths.evaluator_metrics.write_text(json.dumps({"step": 1, "time": 100.0, "eval/val_loss": 4.0}) + "\n"
                                       + json.dumps({"step": 2, "time": 101.0, "eval/val_loss": math.nan}) + "\n")
    atomic_write_json(paths.learner_status(0), {"state": "done", "inner_step": 4, "loss": 3.0})
    summary = write_report(paths, num_learners=1, outcome="completed", wall_time_s=1.0)
    written = strict_load(paths.summary.read_text())
    # The latest validation loss was not finite: the summary says so (null), not the one before it.
    assert written["final_val_loss"] is None and summary["final_val_loss"] is None
    assert [r.get("eval/val_loss") for r in strict_lines(paths.metrics) if r["source"] == "evaluator"] == [4.0, None]


def test_a_checkpointed_state_keeps_its_infinities_and_nans(tmp_path):
    """ReduceLROnPlateau starts with best = inf: a checkpoint must give it back, not None."""
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    state = {"scheduler": scheduler.state_dict(), "last": math.nan}
    save_state(tmp_path, state, serial=1)
    loaded, _, _ = load_latest_state(tmp_path)
    assert loaded["scheduler"]["best"] == math.inf and math.isnan(loaded["last"])
