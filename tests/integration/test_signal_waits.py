"""A SIGTERM is never lost while a process's main thread waits: the syncer serving, a learner joining.

Python runs a signal handler on the main thread only, and only once that thread runs bytecode again; a signal the
kernel hands to another thread (a gRPC thread) just marks the handler due. A main thread blocked in a wait without
a timeout never gets to it: the process ran on forever after its SIGTERM. The kernel picks the thread, so each case
is tried on several processes at once: with a SIGSTOP before the SIGTERM and a SIGCONT after it (what a stopped
job sees; the signal then lands on whichever thread wakes first), and with the SIGTERM sent to one of the process's
other threads (`tgkill`), the case that lost it every time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json
from tests.helpers import TINY_MODEL_FLAGS, Processes, wait_until

pytestmark = pytest.mark.integration

TRIES = 3
"""Processes signalled the STOP, TERM, CONT way (the kernel's choice of thread varies from one to the next)."""
STOP_WAIT_S = 15.0
"""How long a signalled process may take to exit: a clean stop takes about a second."""
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def other_thread(pid: int) -> int:
    """A thread of `pid` that is not its main thread."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert tids, f"process {pid} has no thread besides its main one"
    return tids[0]


def term_elsewhere(pid: int) -> None:
    """SIGTERM to one of the process's other threads, as the kernel may deliver it."""
    if _LIBC.tgkill(pid, other_thread(pid), signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


def stop_term_cont(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.2)  # the SIGTERM pends while the process is stopped: that is the case
    os.kill(pid, signal.SIGCONT)


def assert_all_exit(popens, what: str) -> None:
    deadline = time.monotonic() + STOP_WAIT_S
    alive = []
    for popen in popens:
        try:
            popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            alive.append(popen.pid)
    assert not alive, f"{what}: pids {alive} still running {STOP_WAIT_S} s after their SIGTERM"
    assert [p.returncode for p in popens] == [0] * len(popens), f"{what}: exit codes {[p.returncode for p in popens]}"


@pytest.mark.timeout(120)
def test_a_serving_syncer_stops_on_a_sigterm_whichever_thread_gets_it(tmp_path, procs: Processes):
    run_dirs = [tmp_path / f"run{i}" for i in range(TRIES + 1)]
    popens = [procs.start(f"syncer{i}", "syncer", "--bind", "127.0.0.1:0", "--run-dir", str(run_dir),
                          "--learners", "2", "--allow-no-token", *TINY_MODEL_FLAGS)
              for i, run_dir in enumerate(run_dirs)]
    def serving(popen, run_dir: Path) -> bool:
        return (read_json(run_dir / "syncer.json") or {}).get("pid") == popen.pid

    wait_until(lambda: all(map(serving, popens, run_dirs)), "every syncer serving", alive=popens)
    for popen in popens[:TRIES]:
        stop_term_cont(popen.pid)
    term_elsewhere(popens[TRIES].pid)
    assert_all_exit(popens, "syncers")


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(120)
def test_a_joining_learner_stops_on_a_sigterm_whichever_thread_gets_it(tmp_path, procs: Processes):
    """Learners whose syncer is not there yet wait to join (up to --connect-timeout-s) in their session's start."""
    address = f"127.0.0.1:{unused_port()}"
    run_dirs = [tmp_path / f"run{i}" for i in range(TRIES + 1)]
    popens = [procs.start(f"learner{i}", "learner", "--syncer", address, "--learner-id", "0", "--learners", "1",
                          "--run-dir", str(run_dir), "--threads", "1", *TINY_MODEL_FLAGS)
              for i, run_dir in enumerate(run_dirs)]

    def joining(run_dir: Path) -> bool:
        return (read_json(run_dir / "learners" / "0" / "status.json") or {}).get("state") == "joining"

    wait_until(lambda: all(map(joining, run_dirs)), "every learner joining", alive=popens)
    for popen in popens[:TRIES]:
        stop_term_cont(popen.pid)
    term_elsewhere(popens[TRIES].pid)
    assert_all_exit(popens, "joining learners")
