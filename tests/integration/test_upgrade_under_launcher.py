"""A `ddiloco run` whose package is upgraded on disk while it runs (`pip install -U` under a live run) still ends with
its report. The launcher imported the report's modules only at the end of the run, from the new version beside the old
ones already loaded: `ImportError: cannot import name 'iter_jsonl' from 'ddiloco.checkpoint'`, no summary.json, no
table, no plots, and a Ctrl-C ended in the same traceback with status 1 instead of 130. Here the upgrade is an import
hook in the launcher's interpreter that makes every ddiloco module it has not loaded yet unimportable once the run's
syncer serves."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import SMALL_RUN, TINY_MODEL_FLAGS, ddiloco_run

pytestmark = pytest.mark.integration

HOOK = '''
import os, sys

class _Upgraded:
    """In the launcher (`ddiloco run`), an import of a ddiloco module not loaded yet fails once the run has started (its
    syncer.json exists): the package on disk is another version from then on."""

    def find_spec(self, name, path=None, target=None):
        started = os.environ.get("UPGRADED_ONCE_EXISTS", "")
        if name.startswith("ddiloco.") and started and os.path.exists(started):
            raise ImportError(f"{name}: the package on disk is another version now")
        return None

if sys.argv[1:2] == ["run"]:
    sys.meta_path.insert(0, _Upgraded())
'''


@pytest.mark.timeout(110)
def test_a_run_whose_package_changes_on_disk_midway_still_writes_its_report(tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    run_dir = tmp_path / "run"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("UPGRADED_ONCE_EXISTS", str(run_dir / "syncer.json"))
    code, output = ddiloco_run(run_dir, *SMALL_RUN, *TINY_MODEL_FLAGS, "--inner-steps", "16", "--no-evaluate",
                               command=[sys.executable, "-m", "ddiloco.train_tinygpt"], timeout_s=100)
    assert code == 0, output[-3000:]
    assert "ImportError" not in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["rounds_committed"] > 0, summary
