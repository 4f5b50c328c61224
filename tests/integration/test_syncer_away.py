"""A learner whose syncer is gone (killed, not yet restarted) keeps training, as docs/runtime.md ("Liveness") says:
each update it cannot deliver is dropped, and it no longer waits for that update's round.

Before: it waited `--max-wait-s` (60 s) for the result of every update it could not deliver, a fragment after another:
4 inner steps in a 90 s outage (probe), against about 7 a second. Real processes started by hand, a real SIGKILL."""

from __future__ import annotations

import signal
import time

import pytest

from ddiloco.checkpoint import read_json
from tests.helpers import TINY_MODEL_FLAGS, wait_until
from tests.standalone_syncer import start_syncer

# 16 s: tests/unit/test_learner_undelivered.py runs the rule by default.
pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

OUTAGE_S = 8.0


def test_a_learner_trains_on_while_its_syncer_is_gone(procs, tmp_path, run_token):
    run_dir = tmp_path / "run"
    syncer, address = start_syncer(procs, run_dir, run_token, *TINY_MODEL_FLAGS, "--learners", "1",
                                   "--num-fragments", "2", "--sync-every", "8", "--inner-steps", "1000000")
    learner = procs.start("learner", "learner", "--syncer", address, "--learner-id", "0", "--run-dir",
                          str(run_dir), "--token-file", str(run_token), "--threads", "1", "--checkpoint-every-s",
                          "1000")
    status_file = run_dir / "learners" / "0" / "status.json"

    def inner_step() -> int:
        return (read_json(status_file) or {}).get("inner_step") or 0

    wait_until(lambda: inner_step() > 40, "the learner to train", alive=[learner])
    syncer.send_signal(signal.SIGKILL)
    syncer.wait(timeout=30)
    # Its next updates fail at once (nothing listens): each is dropped, and the learner trains on.
    wait_until(lambda: (read_json(status_file) or {}).get("updates_dropped", 0) >= 2, "updates to be dropped",
               alive=[learner])
    before = inner_step()
    time.sleep(OUTAGE_S)
    trained = inner_step() - before
    assert learner.poll() is None, procs.log("learner")[-3000:]
    status = read_json(status_file)
    assert trained >= 40, (f"{trained} inner steps in {OUTAGE_S} s without a syncer", status,
                           procs.log("learner")[-3000:])
    assert status.get("waits_abandoned", 0) == 0, status
