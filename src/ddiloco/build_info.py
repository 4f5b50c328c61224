"""Which build of ddiloco is running: the package version, and the commit of the source checkout it runs from.

The package version (`ddiloco.__version__`) has been 0.1.0 through hundreds of commits, so `ddiloco --version` did
not tell two builds apart, and nothing in a run directory said which build ran it: a run upgraded in the middle
(`pip install -U`, a `git pull` of an editable install) left no trace of either version (an upgrade probe,
2026-12-07). `build_id()` adds the checkout's commit, `+dirty` where tracked files differ from it; each session's
`run_started` event (`launcher/metrics.jsonl`) and each syncer start (`syncer/metrics.jsonl`) record it.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from ddiloco import __version__

GIT_TIMEOUT_S = 5.0
"""A git that does not answer in this long (a hung network file system) gives no commit, not a hung start."""


@functools.cache
def source_commit() -> str | None:
    """The commit (12 hex digits) of the git checkout this package is imported from, with `+dirty` when its tracked
    files differ from it; None for an installed copy outside a checkout, or where git is missing or refuses."""
    root = Path(__file__).resolve().parents[2]  # src/ddiloco/build_info.py -> the checkout's root
    if not (root / ".git").exists():
        return None
    try:
        head = _git(root, "rev-parse", "--short=12", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if changed else "") if head else None


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                          timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL).stdout.strip()


def build_id() -> str:
    """`0.1.0`, or `0.1.0 (commit 677847d1a2b3)` from a checkout."""
    commit = source_commit()
    return __version__ if commit is None else f"{__version__} (commit {commit})"
