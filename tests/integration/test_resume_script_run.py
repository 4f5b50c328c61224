"""`ddiloco run --resume` of a script run, end to end: real syncer and learner processes running
examples/mlp.py, real gRPC on 127.0.0.1, real signals.

While the run is going, a second launcher's `--resume` is refused in one line naming the first launcher, and writes
nothing into the run directory (it used to overwrite the first one's records and fail on its syncer's lock). Once the
run is stopped, `--resume` without `-- COMMAND` runs the run's own script again, saying so (it used to start the
built-in TinyGPT, which the syncer refused). Every wait has a hard deadline.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import finish_run

# make acceptance (21-26 s on 2 cores): its two behaviours have fake-child siblings in the default suite,
# tests/unit/test_resume_live_run.py and tests/unit/test_resume_learner_command.py
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.acceptance]

REPO = Path(__file__).parents[2]
WAIT_S = 180.0
POLL_S = 0.1
EXIT_USAGE = 2
FAST = ["--learners", "2", "--num-fragments", "2", "--sync-every", "8", "--threads", "1", "--checkpoint-every-s", "0.5"]
SCRIPT = ("python", "examples/mlp.py")


def ddiloco_run(*args: str) -> subprocess.Popen:
    """`ddiloco run --no-progress ARGS` from the repository root, in its own session, output merged."""
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--no-progress", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def inner_step(paths: RunPaths, learner_id: int) -> int:
    return int((read_json_object(paths.learner_status(learner_id)) or {}).get("inner_step", 0))


def records(paths: RunPaths) -> dict[str, bytes]:
    """The launcher's files that a second launcher used to overwrite, by path."""
    files = [paths.processes, paths.learner_command, paths.config, paths.summary, paths.settings("syncer")]
    return {str(path): path.read_bytes() for path in files if path.exists()}


@pytest.mark.timeout(600)
def test_a_live_script_run_refuses_a_second_launcher_and_resumes_with_its_own_command(tmp_path):
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    first = ddiloco_run("--run-dir", str(run_dir), "--inner-steps", "1000000", *FAST, "--", *SCRIPT)
    try:
        deadline = time.monotonic() + WAIT_S
        while not all(inner_step(paths, i) > 0 for i in range(2)):
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the learners did not start training"
            time.sleep(POLL_S)
        before = records(paths)
        second = ddiloco_run("--resume", str(run_dir))
        out = finish_run(second, timeout_s=WAIT_S)
        assert second.returncode == EXIT_USAGE, out
        assert out == (f"ddiloco run: error: --resume {run_dir}: the run is still going (its launcher, ddiloco run "
                       f"pid {first.pid}, is alive): stop it first (Ctrl-C where it runs, or kill it) and resume once "
                       "it has ended\n")
        assert records(paths) == before
        assert first.poll() is None  # the run goes on
    finally:
        out = finish_run(first, timeout_s=WAIT_S, interrupt=True)
    assert first.returncode == 128 + signal.SIGINT, out

    target = max(inner_step(paths, i) for i in range(2)) + 16
    resumed = ddiloco_run("--resume", str(run_dir), "--inner-steps", str(target), "--json")
    out = finish_run(resumed, timeout_s=WAIT_S)
    assert resumed.returncode == 0, out
    assert out.startswith("resuming with the run's command: python examples/mlp.py\n"), out
    summary = read_json_object(paths.summary)
    assert summary["outcome"] == "completed" and summary["sessions"] == 2
    assert [summary["learners"][i]["inner_step"] for i in ("0", "1")] == [target, target]
