"""Resuming a learner of several ranks with another number of ranks: `ddiloco run --resume DIR --nproc-per-learner 3`
of a run that ran `examples/ddp.py --fsdp` with 2 (real processes, real gloo process groups, real gRPC).

The checkpoint holds each of the 2 ranks' shard of the optimizer state; 3 ranks shard the parameters otherwise. Rank 0
used to load its old shard anyway (as plain tensors, since they no longer fit its layout) while the other ranks started
afresh, and died at its first `optimizer.step()` ("aten.lerp_.Scalar got mixed torch.Tensor and DTensor"), restart
after restart, until the learner was given up. Now every rank's optimizer starts afresh, said in one warning, and the
learner resumes its inner step and trains to the new budget.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import finish_run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.acceptance]  # a whole run, twice: make acceptance

REPO = Path(__file__).parents[2]
WAIT_S = 240.0
FAST = ["--learners", "1", "--num-fragments", "2", "--sync-every", "8", "--threads", "1", "--checkpoint-every-s", "0.5",
        "--no-progress"]
FIRST_STEPS = 16
RESUMED_STEPS = 32


def ddiloco_run(*args: str) -> str:
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = finish_run(popen, timeout_s=WAIT_S)
    assert popen.returncode == 0, out
    return out


@pytest.mark.timeout(600)
def test_an_fsdp2_learner_resumed_with_three_ranks_instead_of_two_starts_its_optimizer_afresh_and_trains(tmp_path):
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    ddiloco_run("--run-dir", str(run_dir), *FAST, "--nproc-per-learner", "2", "--inner-steps", str(FIRST_STEPS),
                "--", sys.executable, "examples/ddp.py", "--fsdp")
    ddiloco_run("--resume", str(run_dir), "--nproc-per-learner", "3", "--inner-steps", str(RESUMED_STEPS))

    learner = read_json_object(paths.summary)["learners"]["0"]
    assert (learner["state"], learner["restarts"]) == ("done", 0), learner
    starts = [json.loads(line) for line in (paths.learner_dir(0) / "work.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert [start["inner_step"] for start in starts] == [0, FIRST_STEPS]  # the inner step resumed as saved
    last_start = paths.log("learner-0").read_text().rsplit("=== ", 1)[-1]
    warnings = [line for line in last_start.splitlines() if "the checkpoint holds the state of 2 rank(s)" in line]
    assert warnings == ["[learner 0] the checkpoint holds the state of 2 rank(s), this learner has 3: the other ranks "
                        "start their state= objects afresh, and every rank its optimizer state (sharded over 2 ranks "
                        "when saved; the hyperparameters as saved)"], last_start[-3000:]
    # The ranks share the log, and a print writes its text and its newline apart: one rank's line can land inside
    # another's (`... final {...}learner 0 rank 2 final {...}`), so each is found on its own, not line by line.
    finals = dict(re.findall(r"learner 0 rank (\d) final (\{[^}]*\})", last_start))
    assert sorted(finals) == ["0", "1", "2"], last_start[-3000:]
    assert len(set(finals.values())) == 1, last_start[-3000:]  # the three ranks end with one model
