"""`ddiloco run` started from inside a torchrun (or SLURM) job, end to end: real syncer and learner processes running
examples/mlp.py, real gRPC on 127.0.0.1.

The outer job's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT used to reach every learner of one process,
so each one's `ddiloco.session` set up a torch.distributed group on the outer job's port: one failed with EADDRINUSE
until it was given up, the other waited for it for good. The launcher now leaves them out, and the run finishes.
Every wait has a hard deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.rank_group import free_port
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import finish_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
WAIT_S = 90.0
INNER_STEPS = 16


@pytest.mark.timeout(300)
def test_a_run_started_inside_a_torchrun_job_finishes(tmp_path):
    run_dir = tmp_path / "run"
    outer_job = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "outer"}
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--learners", "2",
                              "--inner-steps", str(INNER_STEPS), "--num-fragments", "2", "--sync-every", "8",
                              "--threads", "1", "--no-progress", "--", "python", "examples/mlp.py"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **outer_job})
    out = finish_run(popen, timeout_s=WAIT_S)
    assert popen.returncode == 0, out
    summary = read_json_object(RunPaths(run_dir).summary)
    assert summary["outcome"] == "completed", summary
    assert [summary["learners"][i]["inner_step"] for i in ("0", "1")] == [INNER_STEPS, INNER_STEPS]
