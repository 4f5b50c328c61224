"""The life of one child process of a local run: started in its own process group, stopped with its group.

Each child leads its own process group (so a Ctrl-C in the terminal reaches only `ddiloco run`, and stopping a child
also stops anything it spawned) and asks the kernel for SIGTERM when the launcher dies (Linux `PR_SET_PDEATHSIG`, so
even a SIGKILLed launcher leaves nothing running; a script behind a wrapper, which that signal does not reach, watches
the launcher named in its environment: `ddiloco.launcher_watch`). Stopping is SIGTERM (and SIGCONT, for a stopped
child), then SIGKILL to the group after a timeout. The SIGTERM goes to the child alone where it is a Python process
(`stops_its_own`): its session stops at its next step and ends what it started, where a SIGTERM to its group killed the
workers of its DataLoader first, and torch's "DataLoader worker (pid N) is killed by signal" failed the learner before
its stop checkpoint; to the whole group where the child is anything else (a wrapper, `bash run.sh`, passes no signal
on), and then the stop waits for the group, not only for the wrapper, which dies of the SIGTERM while the script it
runs still writes its checkpoint. What is started, with which command line, is `ddiloco.runtime.launcher`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddiloco.launcher_watch import process_stats

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.05
"""Poll interval while waiting for a signalled process group to go."""
STOP_NOTICE_AFTER_S = 3.0
"""How long after SIGTERM a child that is still running is said to be waited for (`stop_processes`' `on_wait`). A
learner that stops cleanly flushes its updates (up to 1 s) and writes its checkpoint within about this; one that
takes longer is most likely between two step() calls, which is where it notices the SIGTERM."""
PYTHON_PROGRAM = re.compile(r"^python\d*(\.\d+)?$")
"""A program name that is a Python interpreter (`python`, `python3`, `python3.11`): the child whose session takes a
SIGTERM itself (`ChildProcess.stops_its_own`)."""
PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal the kernel sends a child when its parent thread dies."""

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> None:
    # Runs in the child between fork and exec (only async-signal-safe work: one syscall). The
    # launcher starts children from its main thread only, so "parent thread died" = launcher died.
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def process_group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc").is_dir():
        return True
    return any(int(fields[2]) == pgid and fields[0] != "Z" for _, fields in process_stats())


@dataclass
class ChildProcess:
    """One started child: its own process group, its log file, and how it ended."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path
    log_offset: int
    started_at: float
    """Monotonic seconds."""
    returncode: int | None = None
    stop_requested: bool = False
    """Set by `request_stop`: a wrapper's group then keeps running after the wrapper (`running`)."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code once it has exited (negative: killed by that signal), else None."""
        if self.returncode is None:
            self.returncode = self.popen.poll()
            if self.returncode is not None and not self._group_handles_the_stop:
                # Anything it left in its group (a helper it spawned) goes with it.
                self.signal_group(signal.SIGKILL)
        return self.returncode

    @property
    def _group_handles_the_stop(self) -> bool:
        # A wrapper (`bash run.sh`) dies of the SIGTERM at once, while the script it runs, which got the same SIGTERM,
        # may still be writing its stop checkpoint: the stop waits for its group (`running`) instead.
        return self.stop_requested and not self.stops_its_own

    def running(self) -> bool:
        """Whether a stop still waits for it: its process, or after a stop's SIGTERM to its group (a wrapper), any
        process left in its group."""
        if self.poll() is None:
            return True
        return self._group_handles_the_stop and process_group_alive(self.pid)

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    @property
    def stops_its_own(self) -> bool:
        """Whether a stop's SIGTERM goes to this child alone: a Python process (a learner's script, `ddiloco`'s own
        processes, a rank group, which passes it on to its ranks) stops what it started itself; what it leaves is
        killed with its group once it exits (`poll`)."""
        return bool(self.argv) and PYTHON_PROGRAM.match(Path(self.argv[0]).name) is not None

    def request_stop(self) -> None:
        """SIGTERM, to the child alone or to its group (`stops_its_own`), and SIGCONT to the group: a stopped child
        (SIGSTOP, a chaos hang, Ctrl-Z) handles its SIGTERM only once it runs again (it was SIGKILLed at the timeout
        instead, with its work since its last checkpoint)."""
        self.stop_requested = True
        if self.stops_its_own:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGTERM)
        else:
            self.signal_group(signal.SIGTERM)
        self.signal_group(signal.SIGCONT)

    def close_stdin(self) -> None:
        """End-of-file on a standby's stdin (it exits by itself); nothing for other children."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def stop(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> int:
        """SIGTERM it (`request_stop`), wait up to `timeout_s` for it, then SIGKILL its group."""
        stop_processes([self], timeout_s, clock=clock)
        return self.returncode if self.returncode is not None else self.popen.wait()

    def log_tail(self, max_lines: int = 5) -> list[str]:
        """The last non-empty lines this start wrote to its log (for "why did it exit")."""
        try:
            with self.log_path.open("rb") as file:
                file.seek(self.log_offset)
                text = file.read().decode("utf-8", errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-max_lines:]


def stop_processes(children: Sequence[ChildProcess], timeout_s: float, *,
                   clock: Callable[[], float] = time.monotonic,
                   kill_now: Callable[[], bool] = lambda: False,
                   on_wait: Callable[[list[ChildProcess]], None] = lambda pending: None) -> None:
    """SIGTERM every child at once (`ChildProcess.request_stop`); SIGKILL the groups left after `timeout_s` (or as
    soon as `kill_now()` turns true, e.g. on a second Ctrl-C). `on_wait(pending)` is called once with the children still
    running STOP_NOTICE_AFTER_S after the SIGTERM, if any, so that the wait can be explained. Returns once every
    group is gone."""
    for child in children:
        if child.poll() is None:
            child.request_stop()
    started = clock()
    deadline = started + timeout_s
    noticed = False
    pending = [c for c in children if c.running()]
    while pending and clock() < deadline and not kill_now():
        if not noticed and clock() - started >= STOP_NOTICE_AFTER_S:
            noticed = True
            on_wait(pending)
        time.sleep(STOP_POLL_S)
        pending = [c for c in pending if c.running()]
    waited_s = clock() - started
    why = (f"still running {timeout_s:g} s after SIGTERM" if waited_s >= timeout_s
           else f"SIGKILL asked for (a second stop signal) {waited_s:.1f} s after SIGTERM")  # not a timeout: say so
    for child in pending:
        logger.warning("[%s] %s: SIGKILL", child.name, why)
        child.signal_group(signal.SIGKILL)
    for child in children:
        child.returncode = child.popen.wait()
        child.signal_group(signal.SIGKILL)
