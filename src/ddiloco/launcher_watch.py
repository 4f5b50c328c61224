"""A learner or evaluator whose launcher is gone stops, even when it is not the launcher's own child.

`ddiloco run` asks the kernel to SIGTERM each of its children when it dies (`PR_SET_PDEATHSIG`), but only its
direct children get that signal. A script started through a wrapper (`-- bash wrap.sh` running python as its child,
`uv run`, `conda run`) is a grandchild: after a `kill -9` or an OOM kill of the launcher it ran on with PPID 1,
retrying its lost syncer for ever, and with a fixed `--bind` it even joined the next `--resume`'s syncer and
trained there. So the launcher names itself in each child's environment (`DDILOCO_LAUNCHER_PID`, and
`DDILOCO_LAUNCHER_STARTED`, its start time, so that a reused pid is not mistaken for it; `ddiloco.environment()`
reads them), and a session or `ddiloco.watch` started with them runs a `LauncherWatch`: a daemon thread that looks
every `LAUNCHER_POLL_S` whether that process still lives. Once it is gone the watch asks for the stop a SIGTERM asks
for (`done` turns true after the current step; the session checkpoints and leaves), from any thread, and ends the
process if the session has not ended `LAUNCHER_GONE_EXIT_S` later (a loop that never reaches its next `step()`, a
stop that hangs). That bound is kept by a second thread, started with the first, so it holds even when the call that
asks for the stop never returns (a learner once hung so, with its main thread stuck in its own SIGTERM handler), and
it ends the process without logging (a lock of `logging` may be what is stuck). A process started without them (by
hand, by torchrun, by a scheduler) is not watched.

This module owns that watch and how a process is told apart from a later one with the same pid
(`process_start_time`); what a stop does is the session's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

LAUNCHER_POLL_S = 1.0
"""How often the watch looks for its launcher: one read of /proc/PID/stat, and how late a launcher's death is seen."""
LAUNCHER_GONE_EXIT_S = 30.0
"""How long after its launcher is found gone a session may take to end before the process ends itself: as long as the
launcher gives a learner between its SIGTERM and its SIGKILL (`SupervisorConfig.learner_stop_timeout_s`)."""
EXIT_LAUNCHER_GONE = 128 + 15
"""The exit status of a process that ends itself that way: that of a process ended by the SIGTERM it would have had
from the kernel as the launcher's direct child."""


def process_stat(pid: int | str) -> list[str] | None:
    """The fields of `/proc/PID/stat` after the command name (state, ppid, pgrp, ..., start time at index 19), or None
    when the process is gone. Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()  # "pid (comm) state ppid ...": comm may hold spaces and parentheses


def process_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, `process_stat(pid)`) of every process there is now."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := process_stat(entry.name)) is not None:
            yield int(entry.name), fields


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when it is gone or a zombie: with
    the pid, it names one process even after the pid is reused."""
    fields = process_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def same_process(pid: int, started: int) -> bool:
    """Whether the process that had `pid` and started at `started` (`process_start_time`) still runs."""
    return process_start_time(pid) == started


class LauncherWatch:
    """Watches the launcher `pid` (started at `started`, `process_start_time`) from a daemon thread; once it is gone,
    calls `on_gone()` and, `exit_after_s` later, `exit(EXIT_LAUNCHER_GONE)` unless `stop()` was called by then, whether
    `on_gone()` returned or not (another daemon thread keeps that bound). `stop()`: the session is over, so nothing is
    left to watch or to end."""

    def __init__(self, pid: int, started: int, *, name: str, on_gone: Callable[[], None],
                 poll_s: float = LAUNCHER_POLL_S, exit_after_s: float = LAUNCHER_GONE_EXIT_S,
                 alive: Callable[[int, int], bool] = same_process,
                 exit: Callable[[int], object] = os._exit) -> None:
        self.pid = pid
        self.started = started
        self.name = name
        """Who watches, for the log: `learner 3`, `evaluator`."""
        self.on_gone = on_gone
        self.poll_s = poll_s
        self.exit_after_s = exit_after_s
        self._alive = alive
        self._exit = exit
        self._stop = threading.Event()
        self.gone = threading.Event()
        """Set once the launcher was found gone."""
        self._thread = threading.Thread(target=self._run, name="ddiloco-launcher-watch", daemon=True)
        self._bound = threading.Thread(target=self._exit_when_overdue, name="ddiloco-launcher-watch-bound",
                                       daemon=True)
        """Started now, not once the launcher is gone: starting a thread takes a lock of `threading` that a stuck
        thread may hold."""

    def start(self) -> LauncherWatch:
        self._thread.start()
        self._bound.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while self._alive(self.pid, self.started):
            if self._stop.wait(self.poll_s):
                return
        self.gone.set()
        logger.warning("[%s] its launcher (ddiloco run, pid %d) is gone: stopping as on SIGTERM (checkpoint, leave); "
                       "this process ends itself if it still runs %.0f s from now", self.name, self.pid,
                       self.exit_after_s)
        self.on_gone()

    def _exit_when_overdue(self) -> None:
        while not self.gone.wait(self.poll_s):
            if self._stop.is_set():
                return
        if self._stop.wait(self.exit_after_s):
            return  # the session ended (checkpointed, left): what the script does next is its own
        line = (f"ERROR [{self.name}] its session has not ended {self.exit_after_s:.0f} s after its launcher (pid "
                f"{self.pid}) went (a loop that does not reach its next step(), or a stop that hangs): exiting now "
                "(the last checkpoint stands)\n")
        with contextlib.suppress(OSError):
            os.write(2, line.encode())  # not logging: its lock may be held by the very thread that is stuck
        self._exit(EXIT_LAUNCHER_GONE)


def watch_launcher(launcher: tuple[int, int] | None, *, name: str, on_gone: Callable[[], None]) -> LauncherWatch | None:
    """A started `LauncherWatch` of `launcher` (pid, start time, from `ddiloco.environment()`), or None without one."""
    if launcher is None:
        return None
    pid, started = launcher
    return LauncherWatch(pid, started, name=name, on_gone=on_gone).start()
