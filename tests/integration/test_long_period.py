"""`ddiloco run` with a sync period H at or above the learners' budget: the console says no fragment syncs before the
end, and the one round of each fragment (the learners' last work) is the whole run, unscaled
(`tests/unit/test_protocol.py::test_a_fragment_whose_only_round_is_the_last_work_takes_all_of_it`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TINY_MODEL_FLAGS

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]


@pytest.mark.acceptance  # about 15 s: the default suite's time; the core's rule has a unit test
def test_a_period_past_the_budget_is_noted_and_its_only_round_is_the_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(tmp_path / "run"),
                           "--no-progress", "--json", "--learners", "2", "--inner-steps", "16", "--sync-every", "100",
                           "--num-fragments", "1", "--threads", "1", "--no-evaluate", *TINY_MODEL_FLAGS],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("--sync-every 100 is not below --inner-steps 16: no fragment syncs before the end of training"
            in done.stdout)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["rounds_committed"] == 1
