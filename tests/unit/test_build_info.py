"""Which build is running: `ddiloco --version` and the run directory name the checkout's commit, not 0.1.0 alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ddiloco
from ddiloco import build_info

REPO = Path(__file__).parents[2]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="a source checkout: the tests run from one")
def test_a_checkout_names_its_commit_and_whether_its_tracked_files_differ():
    build_info.source_commit.cache_clear()
    commit = build_info.source_commit()
    head = git("rev-parse", "--short=12", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert commit == head + ("+dirty" if dirty else "")
    assert build_info.build_id() == f"{ddiloco.__version__} (commit {commit})"
    version = subprocess.run([sys.executable, "-m", "ddiloco.cli", "--version"], capture_output=True, text=True,
                             check=True, cwd=REPO).stdout
    assert f"(commit {commit})" in version, version


def test_outside_a_checkout_or_without_git_the_version_alone(tmp_path, monkeypatch):
    copy = tmp_path / "site-packages" / "ddiloco"  # an installed copy: no .git above it
    copy.mkdir(parents=True)
    monkeypatch.setattr(build_info, "__file__", str(copy / "build_info.py"))
    build_info.source_commit.cache_clear()
    try:
        assert build_info.source_commit() is None and build_info.build_id() == ddiloco.__version__
        (tmp_path / ".git").mkdir()  # a directory git does not recognise: git refuses, no commit, no error
        build_info.source_commit.cache_clear()
        assert build_info.source_commit() is None
    finally:
        build_info.source_commit.cache_clear()
