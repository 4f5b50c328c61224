"""A syncer whose process is stopped for longer than the heartbeat timeout (SIGSTOP, as a suspended VM or a debugger
does) does not time out its learners when it runs again: the pause was its own (`Syncer.paused`).

Before: on SIGCONT the syncer's timer ran first and every learner was `gone (heartbeat timeout)`, re-joined, and its
in-flight work was lost (probe: a 40 s stop). Real processes under `ddiloco run`, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import TINY_MODEL_FLAGS, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
PAUSE_S = 3.0
"""Longer than the run's 1.5 s heartbeat timeout, shorter than gRPC's keepalive window (a ping unanswered for 5 s
ends a connection: a syncer stopped that long is disconnected, not timed out)."""


@pytest.mark.acceptance  # about 15 s: the default suite's time; the core's rule has a unit test
def test_a_paused_syncer_does_not_time_its_learners_out(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--learners", "2",
         "--inner-steps", "1000000", "--threads", "1", "--no-evaluate", "--heartbeat-timeout-s", "1.5",
         "--heartbeat-every-s", "0.3", *TINY_MODEL_FLAGS], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    status_file = run_dir / "syncer_status.json"

    def status() -> dict:
        try:
            return json.loads(status_file.read_text())
        except (OSError, ValueError):
            return {}

    try:
        wait_until(lambda: status().get("rounds_committed", 0) >= 5, "rounds", alive=[launcher])
        syncer_pid = json.loads((run_dir / "syncer.json").read_text())["pid"]
        os.kill(syncer_pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(syncer_pid, signal.SIGCONT)
        resumed_at = status().get("rounds_committed", 0)
        wait_until(lambda: status().get("rounds_committed", 0) >= resumed_at + 5, "rounds after the pause",
                   alive=[launcher])
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    log = (run_dir / "logs" / "syncer.log").read_text()
    assert "gone (heartbeat timeout)" not in log, log[-3000:]
    assert "[syncer] paused for" in log, log[-3000:]
