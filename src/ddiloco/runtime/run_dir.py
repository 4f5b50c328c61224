"""Checks that a run directory can be used, made before any process starts.

Every process of a run writes there (config.json, logs, checkpoints, status files, the round log), so a
path that is a file, cannot be created or cannot be written is a user's mistake to report in one line at
once, not a traceback from whichever process writes first. What the files in it are is `launcher.RunPaths`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

PROBE_PREFIX = ".ddiloco-write-test-"
"""Name of the empty file written (and removed at once) to prove a directory can be written: permissions
alone do not say (root ignores them, a read-only mount does not show in them)."""


def require_directory(path: Path, *, flag: str) -> None:
    """ValueError if `path` exists and is not a directory."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory: give a directory for the run (it is created "
                         f"if missing)")


def prepare_run_dir(path: Path, *, flag: str) -> None:
    """Create `path` if needed and prove it can be written; ValueError naming the directory otherwise."""
    require_directory(path, flag=flag)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"run directory {path} cannot be created ({exc.strerror or exc}): choose another "
                         f"{flag}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=path)
    except OSError as exc:
        raise ValueError(f"run directory {path} is not writable ({exc.strerror or exc}): every process of a run "
                         f"writes its logs, checkpoints and status there; make it writable or choose another "
                         f"{flag}") from None
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(probe)
