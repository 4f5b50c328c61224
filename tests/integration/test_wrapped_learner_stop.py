"""A Ctrl-C stops learners behind a wrapper (`-- bash wrap.sh`) with their stop checkpoint.

The stop's SIGTERM goes to a wrapper's whole group: the wrapper (bash) dies of it at once, while the script it runs
writes its stop checkpoint. The launcher SIGKILLed the group as soon as the wrapper had gone (within its 50 ms poll), so
a learner whose checkpoint took longer (an 8 M-parameter model here) was killed mid-stop and its status stayed
`training` (measured before the fix: both learners, each run). Real processes and a real SIGINT.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json
from tests.helpers import SMALL_RUN, wait_until
from tests.integration.test_launcher_gone import SCRIPT, WRAPPER

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

LARGER_MODEL = "nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 4096), nn.Tanh(), nn.Linear(4096, 2)"
"""8.4 M parameters: its checkpoint (model and AdamW state) takes longer than the launcher's poll."""


@pytest.mark.timeout(150)
def test_a_ctrl_c_lets_learners_behind_a_wrapper_write_their_stop_checkpoint(tmp_path):
    script, wrapper, run_dir = tmp_path / "train.py", tmp_path / "wrap.sh", tmp_path / "run"
    script.write_text(SCRIPT.replace("nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)", LARGER_MODEL))
    wrapper.write_text(WRAPPER.format(python=sys.executable, script=script, marks=tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *SMALL_RUN,
                                 "--inner-steps", "1000000", "--", "bash", str(wrapper)],
                                cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        def training() -> bool | None:
            statuses = [read_json(run_dir / "learners" / str(i) / "status.json") or {} for i in range(2)]
            return all(s.get("state") == "training" and s.get("inner_step", 0) > 0 for s in statuses) or None

        wait_until(training, "both learners training", alive=[launcher])
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=90) == 130
        for i in range(2):
            status = read_json(run_dir / "learners" / str(i) / "status.json")
            assert status["state"] == "stopped", status  # checkpointed, not SIGKILLed with the wrapper's group
            assert status["stop_requested"] is True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
