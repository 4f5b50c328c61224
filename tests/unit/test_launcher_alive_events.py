"""A session whose launcher is killed (kill -9 of `ddiloco run`) writes no `run_finished`: the summary of a later
`--resume` counts it from its `run_started` to its last event. The launcher wrote events only when something
happened, so a session that ran 40.8 s with nothing to report after its start counted 4.4 s; it writes an `alive`
event every `ALIVE_EVERY_S` now (real `ddiloco run`, fake children: tests/fake_learners.py)."""

from __future__ import annotations

import os
import signal
import time

from ddiloco.checkpoint import read_jsonl
from ddiloco.runtime.report import build_summary
from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import DRIVER, start_driver, wait_for_learners


def test_a_killed_launchers_session_counts_up_to_its_last_alive_event(tmp_path, fake_command, monkeypatch):
    monkeypatch.setattr("tests.fake_learners.DRIVER", DRIVER.replace(
        "from ddiloco.runtime import run_commands\n",
        "from ddiloco.runtime import run_commands\nrun_commands.ALIVE_EVERY_S = 0.2\n", 1))
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "100000")
    try:
        wait_for_learners(run_dir, popen, 3)
        time.sleep(2.0)  # training, nothing to report
    finally:
        os.killpg(popen.pid, signal.SIGKILL)  # the launcher and its children, as a kill -9 of a whole job
        popen.communicate()
    paths = RunPaths(run_dir)
    events = [e for e in read_jsonl(paths.launcher_metrics) if "event" in e]
    assert "run_finished" not in {e["event"] for e in events}
    alive = [e["time"] for e in events if e["event"] == "alive"]
    assert len(alive) >= 5, events
    started = next(e["time"] for e in events if e["event"] == "run_started")
    summary = build_summary(paths, num_learners=3, outcome="completed", wall_time_s=0.0)
    # From its start to its last event (an alive one, or a later one), as the summary rounds it: 3 decimals.
    assert summary["wall_time_total_s"] == round(max(e["time"] for e in events) - started, 3)
    assert alive[-1] - started >= 1.5  # the learners trained 2 s before the kill; an alive event every 0.2 s
