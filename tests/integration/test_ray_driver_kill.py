"""`ddiloco run --ray` on a real local Ray instance, where the driver dies hard or another Ray is named.

A kill -9 of the `ddiloco run --ray` driver takes its local Ray instance with it (the GCS and raylet die with the
driver); each actor's worker then exits, and its learner must get SIGTERM (`PR_SET_PDEATHSIG`), not Ray's SIGKILL,
so that it saves a checkpoint at the inner step it reached and says stopped, as under the local launcher. And a
plain `--ray` starts its own instance even where `RAY_ADDRESS` names a cluster. Skipped only where Ray is not
installed (`pip install -e '.[ray]'`; CI installs it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.ray_cluster import descendants, still_running
from ddiloco.runtime.run_paths import RunPaths

pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.acceptance]

REPO = Path(__file__).parents[2]
WAIT_S = 180.0
"""Hard limit on one wait: Ray's start and three processes importing torch on a loaded 2-core machine; Ray's
agents outlive a killed driver by about a minute."""
POLL_S = 0.1
TRAINED_STEPS = 5
"""Inner steps each learner trains before the driver is killed: past its first checkpoint (`CHECKPOINT_EVERY_S`)."""
CHECKPOINT_EVERY_S = "3600"
"""Longer than the test: a checkpoint at the learner's last inner step can only be the one its stop saved."""
TINY = ["--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1", "--model-context-len", "32",
        "--data-context-len", "32", "--data-batch-size", "4", "--num-fragments", "2", "--sync-every", "8",
        "--threads", "1", "--no-evaluate", "--learners", "2"]


def start_run(run_dir: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    # Its own session, like a job started from a shell: a signal sent to it reaches only it.
    argv = [sys.executable, "-m", "ddiloco.cli", "run", "--ray", "--run-dir", str(run_dir), "--no-progress", *TINY,
            *flags]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def learner_status(run_dir: Path, learner_id: int) -> dict:
    return read_json_object(RunPaths(run_dir).learner_status(learner_id)) or {}


def wait_for(condition, what: str, *, seen: dict[int, int] | None = None, root: int | None = None):
    """`condition()` once truthy; every descendant of `root` is noted in `seen` on the way."""
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        if root is not None and seen is not None:
            for pid, started in descendants(root).items():
                seen.setdefault(pid, started)
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(POLL_S)
    return value


def end_all(popen: subprocess.Popen, seen: dict[int, int]) -> list[int]:
    """SIGKILL the driver and whatever of `seen` still runs (never left running); the pids that were left."""
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait()
    left = still_running(seen)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.timeout(600)
def test_a_killed_driver_leaves_every_learner_stopped_with_a_checkpoint_at_its_last_inner_step(tmp_path):
    run_dir = tmp_path / "run"
    popen = start_run(run_dir, "--inner-steps", "1000000", "--checkpoint-every-s", CHECKPOINT_EVERY_S)
    seen: dict[int, int] = {}
    try:
        def training(learner_id: int) -> bool:
            status = learner_status(run_dir, learner_id)
            return status.get("state") == "training" and status.get("inner_step", 0) >= TRAINED_STEPS

        wait_for(lambda: training(0) and training(1), "both learners to train", seen=seen, root=popen.pid)
        for pid, started in descendants(popen.pid).items():
            seen.setdefault(pid, started)
        learners = [learner_status(run_dir, learner_id)["pid"] for learner_id in (0, 1)]
        assert set(learners) <= set(seen), (learners, seen)
        popen.send_signal(signal.SIGKILL)
        popen.wait()
        wait_for(lambda: not still_running({pid: seen[pid] for pid in learners}), "both learners to exit")
        for learner_id in (0, 1):
            status = learner_status(run_dir, learner_id)
            assert status["state"] == "stopped" and status["stop_requested"], status
            assert status["checkpoint_inner_step"] == status["inner_step"] >= TRAINED_STEPS, status
        wait_for(lambda: not still_running(seen), "every process of the run and of its Ray instance to exit")
    finally:
        left = end_all(popen, seen)
    assert not left, f"processes left behind: {left}"


@pytest.mark.timeout(600)
def test_plain_ray_starts_its_own_instance_where_ray_address_names_another(tmp_path):
    # 127.0.0.1:1: nothing listens there; without address="local", ray.init would try to join it.
    run_dir = tmp_path / "run"
    popen = start_run(run_dir, "--inner-steps", "16", env={"RAY_ADDRESS": "127.0.0.1:1"})
    seen: dict[int, int] = {}
    try:
        wait_for(lambda: popen.poll() is not None, "the run to end", seen=seen, root=popen.pid)
        out = popen.stdout.read()
        assert popen.returncode == 0, out
        assert "started a local Ray instance" in out, out
        assert (read_json_object(RunPaths(run_dir).summary) or {}).get("outcome") == "completed", out
    finally:
        left = end_all(popen, seen)
    assert not left, f"processes left behind: {left}"
