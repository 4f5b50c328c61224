"""Signals that reach `ddiloco run` once its children have stopped, while it writes its report: they ask for a stop
that is already over. Python's own handlers were back in place by then, so a SIGTERM ended the launcher with no
summary.json and a Ctrl-C interrupted it; and a stop asked for once every learner was done called the run
"interrupted" (real processes: `ddiloco run` with the fake children of tests/fake_learners.py)."""

from __future__ import annotations

import os
import signal

from ddiloco.checkpoint import read_json_object
from tests.fake_learners import DRIVER, WAIT_S, start_driver

SIGNALLED_AT_THE_REPORT = """
import os, signal
import ddiloco.runtime.report as report
real = report.write_report
def write_report(*args, **kwargs):
    for signum in (signal.SIGTERM, signal.SIGINT):
        os.kill(os.getpid(), signum)  # handled here, on this (the main) thread, before the next line
    return real(*args, **kwargs)
report.write_report = write_report
"""


def test_a_sigterm_and_a_ctrl_c_while_the_report_is_written_leave_a_completed_run_completed(tmp_path, fake_command,
                                                                                             monkeypatch):
    monkeypatch.setattr("tests.fake_learners.DRIVER", DRIVER.replace("sys.exit(", SIGNALLED_AT_THE_REPORT + "sys.exit(",
                                                                     1))
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "20")
    try:
        out, _ = popen.communicate(timeout=WAIT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
    assert popen.returncode == 0, out
    summary = read_json_object(run_dir / "summary.json")
    assert summary is not None and summary["outcome"] == "completed", out
    assert "completed:" in out and "--resume" not in out, out


def test_a_sigterm_before_the_launchers_own_handlers_undoes_the_start_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    # It ended the launcher at once (Python's default), leaving a run directory the same command then refused.
    from ddiloco.cli import main
    from ddiloco.runtime import run_commands

    real = run_commands.launch_config

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, on this (the main) thread
        return real(*args, **kwargs)

    monkeypatch.setattr(run_commands, "launch_config", signalled)
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress"]) == 128 + signal.SIGTERM
    assert "ddiloco run: interrupted" in capsys.readouterr().err
    assert not run_dir.exists() or not any(run_dir.iterdir())  # the same command may be given again
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
