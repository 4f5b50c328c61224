"""`stop_processes`: SIGTERM every child's group, SIGKILL what is left after the timeout or at once on a second stop
signal, and a log line that says which of the two it was (real child processes that ignore SIGTERM)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from ddiloco.runtime.child_process import ChildProcess, stop_processes

IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                   "time.sleep(60)")


def stubborn(tmp_path, name: str) -> ChildProcess:
    popen = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert popen.stdout.readline() == "ready\n"  # its handler is in place
    return ChildProcess(name, [], popen, tmp_path / f"{name}.log", 0, time.monotonic())


def test_a_second_stop_signal_kills_at_once_and_the_log_does_not_call_it_a_timeout(tmp_path, caplog):
    # It logged `still running 30 s after SIGTERM: SIGKILL` 0.03 s after the SIGTERM.
    child = stubborn(tmp_path, "learner-0")
    with caplog.at_level(logging.WARNING, logger="ddiloco.runtime.child_process"):
        stop_processes([child], 30.0, kill_now=lambda: True)
    assert child.returncode == -9
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("[learner-0] SIGKILL asked for (a second stop signal) ") and line.endswith(
        " s after SIGTERM: SIGKILL"), line


def test_a_child_still_running_at_the_timeout_is_killed_and_the_log_says_so(tmp_path, caplog):
    child = stubborn(tmp_path, "syncer")
    with caplog.at_level(logging.WARNING, logger="ddiloco.runtime.child_process"):
        stop_processes([child], 0.2)
    assert child.returncode == -9
    assert [r.getMessage() for r in caplog.records] == ["[syncer] still running 0.2 s after SIGTERM: SIGKILL"]


def test_a_stopped_child_is_continued_so_that_it_handles_its_sigterm(tmp_path):
    # A SIGSTOPped learner saw its SIGTERM only at the SIGKILL, 30 s later: it never checkpointed.
    # A handler of its own, as a learner's session has: the kernel ends a stopped process with no handler by itself.
    handles = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
               "print('ready', flush=True); time.sleep(60)")
    popen = subprocess.Popen([sys.executable, "-c", handles], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert popen.stdout.readline() == "ready\n"
    os.kill(popen.pid, signal.SIGSTOP)
    child = ChildProcess("learner-0", [], popen, tmp_path / "learner-0.log", 0, time.monotonic())
    stop_processes([child], 10.0)
    assert child.returncode == 7  # not -9: it ran its SIGTERM handler


# A grandchild in the child's group that says whether a SIGTERM reached it (a DataLoader worker, a wrapped script), half
# a second after it (a stop checkpoint being written: a CI run's wrapper was gone, and its group SIGKILLed, before the
# grandchild's handler had run).
GRANDCHILD = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), "
              "pathlib.Path(sys.argv[1]).write_text('SIGTERM'), sys.exit(0))); "
              "pathlib.Path(sys.argv[1] + '.ready').touch(); time.sleep(60)")
PARENT = ("import signal, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
          "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)")


def test_a_python_child_alone_gets_the_sigterm_and_a_wrapper_passes_it_to_its_group(tmp_path):
    # A learner's DataLoader workers share its group: a SIGTERM to the group killed them before the learner's session
    # reached its next step, and torch failed the learner ("DataLoader worker (pid N) is killed by signal").
    # A Python child stops what it started itself (what it leaves goes with its group once it exits); a wrapper
    # (`sh -c`, `bash run.sh`) passes no signal on, so its group gets it.
    python_flag, shell_flag = tmp_path / "python", tmp_path / "shell"
    python_argv = [sys.executable, "-c", PARENT, GRANDCHILD, str(python_flag)]
    shell_argv = ["/bin/sh", "-c", f'"{sys.executable}" -c "$0" "$1"; sleep 60', GRANDCHILD, str(shell_flag)]
    children = []
    for name, argv, flag in (("learner-0", python_argv, python_flag), ("learner-1", shell_argv, shell_flag)):
        popen = subprocess.Popen(argv, start_new_session=True)
        children.append(ChildProcess(name, argv, popen, tmp_path / f"{name}.log", 0, time.monotonic()))
        deadline = time.monotonic() + 30
        while not flag.with_name(flag.name + ".ready").exists():
            assert time.monotonic() < deadline, f"{name}'s grandchild never started"
            time.sleep(0.02)
    assert [child.stops_its_own for child in children] == [True, False]
    stop_processes(children, 10.0)
    assert children[0].returncode == 0 and not python_flag.exists()  # the grandchild got SIGKILL with the group
    assert shell_flag.read_text() == "SIGTERM"
