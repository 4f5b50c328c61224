"""The bandwidth planner's byte prediction against what a real `ddiloco run` moved.

Real syncer and learner processes, real gRPC on 127.0.0.1. The learners' byte counters count
whole protobuf messages (headers, names and heartbeats included), the prediction counts payloads, so
the two may differ by the framing: the planner promises 5 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddiloco.config import DilocoConfig
from ddiloco.model import build_model
from ddiloco.plan.run_bytes import fragment_numels, predict_run_bytes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
LEARNERS = 2
INNER_STEPS = 60
"""A multiple of the round spacing (H / P = 4): the last round falls due at the last inner step, so a learner
may finish and leave while the other has yet to report to it (that round must still wait for it: K = M)."""
RUN_TIMEOUT_S = 240


@pytest.mark.acceptance  # a benchmark-like check of the planner (17 s): the default suite took 940 s on 2 cores
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_predicted_bytes_match_a_real_run_within_five_percent(tmp_path):
    # K = M and no grace: every round merges both learners, as the prediction assumes.
    argv = [sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(tmp_path / "run"), "--no-progress",
            "--json", "--learners", str(LEARNERS), "--inner-steps", str(INNER_STEPS), "--min-quorum",
            str(LEARNERS), "--grace", "none", "--threads", "1"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    config = DilocoConfig()
    torch.manual_seed(0)
    params = dict(build_model().named_parameters())
    predicted = predict_run_bytes(fragment_numels=fragment_numels(params, config), codec=config.codec,
                                  sync_every=config.sync_every, inner_steps=INNER_STEPS, learners=LEARNERS,
                                  downlink_codec=config.downlink_codec)
    assert predicted.flush_sent > 0  # INNER_STEPS is not a round boundary: the end publishes the last steps
    genesis = []
    for learner_id in range(LEARNERS):
        measured = summary["learners"][str(learner_id)]
        sent = measured["bytes_sent"]
        # A learner that found the run without a genesis uploaded its initial parameters once; learners
        # that join at the same moment may both do so (the first upload wins, the other is told so).
        proposed = sent > predicted.learner_sent + predicted.genesis_sent / 2
        genesis.append(proposed)
        expected = predicted.learner_sent + (predicted.genesis_sent if proposed else 0)
        assert sent == pytest.approx(expected, rel=0.05)
        # The flush rounds' results reach a learner only if they come before it leaves: a range.
        received = measured["bytes_received"]
        assert predicted.learner_received * 0.95 <= received
        assert received <= (predicted.learner_received + predicted.flush_received_max) * 1.05
    assert 1 <= genesis.count(True) <= LEARNERS
