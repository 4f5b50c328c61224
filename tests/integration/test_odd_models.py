"""Models of odd shape under `ddiloco run`: real processes, real gRPC.

A parameter with no values, one that is a strided view (`nn.Parameter(w.t())`): the run trains and exports them as
any other. Initial parameters the syncer refuses (NaN): the learners stop at once with its reason, not retry for
ever (they did: the run sat at inner step 0 until it was stopped). A script that fails at the same step at every
restart (a learning-rate schedule shorter than the run): the learners are given up with its error after three
restarts, not restarted up to `max_restarts` (100) times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ODD_MODEL_SCRIPT, SMALL_RUN, ddiloco_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
RUN_TIMEOUT_S = 120


def run(tmp_path: Path, mode: str) -> tuple[int, str, dict]:
    """`ddiloco run` of the script in `mode`: (its exit status, its output, its summary)."""
    script = tmp_path / "odd.py"
    script.write_text(ODD_MODEL_SCRIPT)
    run_dir = tmp_path / "run"
    status, output = ddiloco_run(run_dir, *SMALL_RUN, "--inner-steps", "40",
                                 command=(sys.executable, str(script), mode), timeout_s=RUN_TIMEOUT_S)
    return status, output, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.acceptance  # a whole run; the session's checks of such parameters are unit tests
def test_a_parameter_without_values_and_a_strided_one_train_and_export(tmp_path):
    status, output, summary = run(tmp_path, "odd")
    assert status == 0, output
    assert summary["outcome"] == "completed" and summary["rounds_committed"] >= 4
    for learner in summary["learners"].values():  # each token once (it read about P = 2 times the tokens trained)
        assert 0.8 * learner["tokens"] <= learner["tokens_merged"] <= learner["tokens"] + 1, learner
    out = tmp_path / "model.safetensors"
    subprocess.run([sys.executable, "-m", "ddiloco.cli", "export", str(tmp_path / "run"), "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    sys.path.insert(0, str(tmp_path))
    try:
        import odd  # the user's module, written above
    finally:
        sys.path.remove(str(tmp_path))
    model, exported = odd.build("odd"), load_file(out)
    model.load_state_dict(exported)  # strict: every parameter, the empty one too
    assert exported["none"].shape == (0, 4)
    assert not torch.equal(exported["mix"], odd.build("odd").mix)  # it trained


def test_initial_parameters_the_syncer_refuses_stop_the_learners_with_its_reason(tmp_path):
    status, output, summary = run(tmp_path, "nan")
    assert status != 0, output
    assert summary["outcome"] == "failed" and summary["rounds_committed"] == 0
    for learner in summary["learners"].values():
        assert learner["state"] == "refused" and learner["restarts"] == 0
        assert "non_finite" in learner["reason"] and "body.2.bias" in learner["reason"]


@pytest.mark.acceptance  # four starts of each learner (22 s): the rule itself has fake-learner unit tests
def test_a_script_failing_at_the_same_step_at_every_restart_is_given_up_with_its_error(tmp_path):
    status, output, summary = run(tmp_path, "short_schedule")
    assert status != 0, output
    assert summary["outcome"] == "failed", summary
    for learner in summary["learners"].values():
        assert learner["state"] == "failed" and learner["restarts"] == 3, learner
        # The scheduler's count goes on from its saved state: 13, 14, 15, 16.
        assert learner["reason"].startswith("ValueError: Tried to step 16 times. The specified number of total "
                                            "steps is 12"), learner
        assert "3 restarts in a row failed without training past inner step 12" in learner["reason"], learner
