"""`ddiloco run --resume DIR` of a `--nproc-per-learner 2` run, end to end: real syncer, real rank groups running
examples/ddp.py on real gloo process groups, real gRPC on 127.0.0.1, a real SIGINT.

The run is stopped with Ctrl-C and resumed with only `--resume` and a larger budget, as the console tells the user
to. The resume used to start the learner as one process without RANK, which crash-looped in `init_process_group`
until it was given up (exit 1); it now runs the learner as the 2 ranks it last ran with, and finishes. Every wait has
a hard deadline.
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
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import finish_run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.acceptance]  # a whole run, twice: make acceptance

REPO = Path(__file__).parents[2]
WAIT_S = 120.0
POLL_S = 0.1
FAST = ["--learners", "1", "--num-fragments", "2", "--sync-every", "8", "--threads", "1", "--checkpoint-every-s",
        "0.5", "--no-progress"]


def ddiloco_run(*args: str) -> subprocess.Popen:
    """`ddiloco run ARGS` from the repository root, in its own session, output merged."""
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def inner_step(paths: RunPaths) -> int:
    return int((read_json_object(paths.learner_status(0)) or {}).get("inner_step", 0))


@pytest.mark.timeout(300)
def test_a_stopped_run_of_two_ranks_per_learner_resumes_as_two_ranks(tmp_path):
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    first = ddiloco_run("--run-dir", str(run_dir), "--inner-steps", "1000000", "--nproc-per-learner", "2", *FAST,
                        "--", "python", "examples/ddp.py")
    try:
        deadline = time.monotonic() + WAIT_S
        while inner_step(paths) < 1:
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the learner did not start training"
            time.sleep(POLL_S)
    finally:
        out = finish_run(first, timeout_s=WAIT_S, interrupt=True)
    assert first.returncode == 128 + signal.SIGINT, out
    assert f"continue it with: ddiloco run --resume {run_dir}\n" in out

    target = inner_step(paths) + 8
    resumed = ddiloco_run("--resume", str(run_dir), "--inner-steps", str(target), "--no-progress", "--json")
    out = finish_run(resumed, timeout_s=WAIT_S)
    assert resumed.returncode == 0, out
    kept = "--nproc-per-learner 2 --threads 1 --checkpoint-every-s 0.5"  # FAST's
    assert f"resuming with the run's {kept}\n" in out, out
    summary = read_json_object(paths.summary)
    assert summary["outcome"] == "completed" and summary["learners"]["0"]["inner_step"] == target, summary
    assert len(read_json_object(paths.learner_dir(0) / "ranks.json")["ranks"]) == 2
