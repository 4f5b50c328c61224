"""`ddiloco run` end to end: real syncer and learner processes, real gRPC on 127.0.0.1, real signals.

A model far smaller than the default keeps each test to seconds of training; process start-up
(importing torch, four times) is most of the cost. Every wait has a hard deadline.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.build_info import build_id
from ddiloco.checkpoint import load_latest_state, read_json_object
from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.training import InnerConfig, inner_lr
from tests.helpers import finish_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
WAIT_S = 120.0
"""Hard limit on any one wait (process start-up on a loaded 2-core machine takes seconds)."""
POLL_S = 0.1
TINY = ["--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1", "--model-context-len", "32",
        "--data-context-len", "32", "--data-batch-size", "4", "--num-fragments", "2", "--sync-every", "8",
        "--threads", "1"]
"""A model of a few thousand parameters: rounds every few milliseconds of training."""


def ddiloco_run(run_dir: Path, *flags: str) -> subprocess.Popen:
    # Its own session, like a job started from a shell: a signal sent to it reaches only it.
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress",
                             *TINY, *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(condition, what: str, popen: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if popen.poll() is not None:
            pytest.fail(f"ddiloco run exited ({popen.returncode}) while waiting for {what}:\n"
                        f"{popen.communicate()[0]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(POLL_S)


def learner_status(run_dir: Path, learner_id: int) -> dict:
    return read_json_object(RunPaths(run_dir).learner_status(learner_id)) or {}


def accepted(run_dir: Path, learner_id: int) -> int:
    learners = (read_json_object(RunPaths(run_dir).syncer_status) or {}).get("learners") or {}
    return int((learners.get(str(learner_id)) or {}).get("accepted", 0))


def started_pids(run_dir: Path) -> list[int]:
    processes = read_json_object(RunPaths(run_dir).processes) or {"children": {}}
    return [pid for pids in processes["children"].values() for pid in pids]


@pytest.mark.timeout(300)
def test_short_run_writes_the_run_directory_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    popen = ddiloco_run(run_dir, "--learners", "2", "--inner-steps", "48", "--json")
    out = finish_run(popen, timeout_s=WAIT_S)
    assert popen.returncode == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed"
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert summary["rounds_committed"] == len(rounds) > 0
    assert [r["round"] for r in rounds] == list(range(len(rounds)))  # none lost, none repeated
    assert summary["final_val_loss"] is not None and math.isfinite(summary["final_val_loss"])
    for learner_id in ("0", "1"):
        learner = summary["learners"][learner_id]
        assert learner["state"] == "done" and learner["restarts"] == 0
        assert learner["inner_step"] == 48 and learner["tokens"] > 0
        assert learner["updates_accepted"] > 0 and learner["updates_rejected"] is not None
        assert learner["rounds_contributed"] > 0
        # Every token it trained reached the global model, its last steps included (tests/unit/test_last_work.py).
        assert learner["tokens_merged"] == learner["tokens"], learner
        # Its last step ran at the cooldown's last rate (the optimizer of its checkpoint at the end).
        state, _, serial = load_latest_state(run_dir / "learners" / learner_id / "checkpoint")
        assert serial == 48
        assert state["learner"]["optimizer"]["param_groups"][0]["lr"] == pytest.approx(inner_lr(InnerConfig(), 47, 48))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["inner_steps"] == 48 and config["num_learners"] == 2 and config["model"]["width"] == 32
    # The initial model a learner proposed is in its bytes sent, and the summary says so (else its uplink reads as twice
    # the other's, unexplained): TinyGPT's float32 values, at least 4 bytes a parameter.
    syncer_events = [json.loads(line) for line in (run_dir / "syncer" / "metrics.jsonl").read_text().splitlines()]
    (genesis,) = [r for r in syncer_events if r.get("event") == "genesis"]
    proposed = {i: row["genesis_bytes_sent"] for i, row in summary["learners"].items() if row["genesis_bytes_sent"]}
    assert proposed and all(4 * genesis["parameters"] <= size < summary["learners"][i]["bytes_sent"]
                            for i, size in proposed.items()), (proposed, genesis)
    assert "bytes sent include the initial model" in out
    for name in ("metrics.jsonl", "val_loss.png", "participation.png", "bytes.png"):
        assert (run_dir / name).stat().st_size > 0, name
    # Which build ran the session and its syncer (ddiloco.build_info): the version alone did not tell builds apart.
    for path, event in ((run_dir / "launcher" / "metrics.jsonl", "run_started"),
                        (run_dir / "syncer" / "metrics.jsonl", "start")):
        (started,) = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == event]
        assert started["ddiloco"] == build_id(), started
    assert_all_gone(started_pids(run_dir))


def assert_all_gone(pids: list[int]) -> None:
    assert pids, "no child process was recorded"
    alive = [pid for pid in pids if process_group_alive(pid)]
    assert not alive, f"process groups left behind: {alive}"


@pytest.mark.timeout(300)
def test_ctrl_c_leaves_no_process_behind_and_resume_continues_the_run(tmp_path):
    run_dir = tmp_path / "run"
    popen = ddiloco_run(run_dir, "--learners", "2", "--inner-steps", "1000000")
    try:
        wait_for(lambda: all(learner_status(run_dir, i).get("inner_step", 0) > 0 for i in range(2)),
                 "both learners to train", popen)
        pids = started_pids(run_dir)
    finally:
        out = finish_run(popen, timeout_s=WAIT_S, interrupt=True)
    assert popen.returncode == 128 + signal.SIGINT, out
    assert len(pids) == 4  # syncer, 2 learners, the built-in evaluator
    assert_all_gone(pids)
    summary = read_json_object(run_dir / "summary.json")
    assert summary["outcome"] == "interrupted"
    assert f"--resume {run_dir}" in out

    # Continue it, a few inner steps past where the learners stopped (flags still apply on --resume).
    target = max(learner_status(run_dir, i)["inner_step"] for i in range(2)) + 40
    resumed = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--resume", str(run_dir), "--no-progress",
                                "--inner-steps", str(target), "--json"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = finish_run(resumed, timeout_s=WAIT_S)
    assert resumed.returncode == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["sessions"] == 2
    assert [summary["learners"][i]["inner_step"] for i in ("0", "1")] == [target, target]
    rounds = [json.loads(line)["round"] for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert rounds == list(range(len(rounds))) and len(rounds) > 0  # no round lost or repeated
    assert_all_gone(started_pids(run_dir))


@pytest.mark.acceptance  # test_learner_process.py's kill -9 of a learner covers the default suite, in half the time
@pytest.mark.timeout(300)
def test_a_sigkilled_learner_is_restarted_and_contributes_again(tmp_path):
    run_dir = tmp_path / "run"
    popen = ddiloco_run(run_dir, "--learners", "3", "--inner-steps", "1000000")
    try:
        wait_for(lambda: accepted(run_dir, 1) > 0 and "pid" in learner_status(run_dir, 1),
                 "learner 1 to contribute", popen)
        victim = learner_status(run_dir, 1)["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: learner_status(run_dir, 1).get("pid") not in (None, victim)
                 and learner_status(run_dir, 1).get("state") == "training", "learner 1 to train again", popen)
        # Whatever the killed process sent arrived long before its successor started (backoff plus start-up).
        before = accepted(run_dir, 1)
        wait_for(lambda: accepted(run_dir, 1) > before, "the restarted learner's update to be accepted", popen)
    finally:
        out = finish_run(popen, timeout_s=WAIT_S, interrupt=True)
    assert popen.returncode == 128 + signal.SIGINT, out
    summary = read_json_object(run_dir / "summary.json")
    assert summary["learners"]["1"]["restarts"] == 1
    assert summary["learners"]["0"]["restarts"] == summary["learners"]["2"]["restarts"] == 0
    assert_all_gone(started_pids(run_dir))

