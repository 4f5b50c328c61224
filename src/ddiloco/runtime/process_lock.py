"""Exclusive `flock`s that one process holds for as long as it lives.

The kernel releases a flock when its process ends, `kill -9` included, so a lock left by a process that died never
blocks the next one, and taking it is the check and the claim at once: two processes that try in the same instant
cannot both hold it. A run directory has two: its serving syncer's (`ProcessLock` on `DIR/syncer.lock`:
`syncer_standby.SyncerLock`) and its launcher's (`DirectoryLock` on `DIR` itself: `run_dir.claim_run_dir`). `flock`
is reliable on a local file system; on a network file system it depends on the server (NFSv4 maps it to byte-range
locks). Python opens the descriptors close-on-exec, so the processes a holder starts do not share its lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    return True


class _HeldFlock:
    """An exclusive flock on `path` that this process may hold: the descriptor it holds it through, and giving it up."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def release(self) -> None:
        """Give the lock up (closing the descriptor drops it); nothing when not held."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ProcessLock(_HeldFlock):
    """The exclusive lock on the file `path`, held until `release` or the process exits. The holder writes its pid
    into the file, for messages."""

    def try_acquire(self) -> bool:
        """Take the lock if no live process holds it; True when this process holds it now. Creates the file (not its
        directory) if missing."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_flock(fd):
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def held(self) -> bool:
        """True while a live process holds the lock. Probed with a shared lock dropped at once (closing the file
        drops it), so the probe keeps no one from taking the lock beyond this call."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # no lock file: no process has held it
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def holder(self) -> str:
        """The pid written by the process that holds (or last held) the lock, for messages."""
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"


class DirectoryLock(_HeldFlock):
    """The exclusive lock on the directory `path` itself, held until `release` or the process exits. Nothing is
    written for it, so a process that takes it and then refuses to go on leaves the directory as it was; who holds it
    is for the holder to record elsewhere."""

    def try_acquire(self) -> bool:
        """Take the lock if no live process holds it; True when this process holds it now."""
        if self._fd is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            if _try_flock(fd):
                self._fd = fd
        return self._fd is not None
