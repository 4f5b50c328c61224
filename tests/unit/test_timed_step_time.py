"""The run's step time, behind every round's grace window, is the one the learners time, their waits for results left
out (`Update.step_time_s`). Until 2026-12-07 the syncer took the spacing of each learner's updates, which those waits
stretch: over a long round trip a learner waits at most publishes, and the step time came out many times the real
one (0.148 s for 3.6 ms steps behind a 0.5 s round trip: tests/integration/test_far_link.py), so every grace window
sat at its cap. The spacing is still the estimate where no step time is given (the virtual-time harness).
"""

import math

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import QuorumConfig
from ddiloco.inprocess import InProcessHub
from ddiloco.learner import Learner
from ddiloco.messages import Join, Rejected, RejectReason, Send, Update
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of, sgd, single_fragment

STEP_S = 0.01
"""The learners' compute time per inner step."""
WAIT_S = 0.5
"""How long each learner waits for a result after each update (a long round trip)."""
STEPS_PER_UPDATE = 4


def run_syncer(step_time_s: float | None) -> Syncer:
    """Two learners publishing every STEPS_PER_UPDATE inner steps of STEP_S, each update followed by a WAIT_S wait;
    each update names `step_time_s` (None: not timed)."""
    config = single_fragment(overlap_steps=3)
    syncer = Syncer(config, QuorumConfig(min_quorum=1, grace="adaptive", heartbeat_timeout_s=1000.0),
                    initial_params=params_of(TinyNet(seed=1)))
    codec = get_codec(config.codec)
    payload = {spec.name: codec.encode(torch.zeros(spec.shape)) for spec in syncer.spec.tensors}
    for learner_id in (0, 1):
        syncer.receive(Join(learner_id, syncer.spec, config.fingerprint()), now=0.0)
    now, inner_step = 0.0, 0
    for _ in range(20):
        now += STEPS_PER_UPDATE * STEP_S
        inner_step += STEPS_PER_UPDATE
        for learner_id in (0, 1):
            update = Update(learner_id, 0, syncer.versions[0], inner_step, STEPS_PER_UPDATE, STEPS_PER_UPDATE,
                            config.codec, payload, step_time_s=step_time_s)
            actions = syncer.receive(update, now)
            assert not [a for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]
        now += WAIT_S
        syncer.advance(now)
    return syncer


def test_the_step_time_the_learners_timed_leaves_their_waits_out():
    timed = run_syncer(STEP_S)
    assert timed.step_time.value == pytest.approx(STEP_S)
    assert timed.grace_window() <= 2 * STEP_S  # the cap: tau - 1 = 2 of the learners' steps
    assert all(info.step_time_s == pytest.approx(STEP_S) for info in timed.learners.values())
    spaced = run_syncer(None)  # not timed: the spacing, waits included
    assert spaced.step_time.value == pytest.approx(STEP_S + WAIT_S / STEPS_PER_UPDATE)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.01])
def test_a_step_time_that_is_no_duration_is_refused(bad):
    config = single_fragment()
    syncer = Syncer(config, QuorumConfig(min_quorum=1), initial_params=params_of(TinyNet(seed=1)))
    syncer.receive(Join(0, syncer.spec, config.fingerprint()), now=0.0)
    codec = get_codec(config.codec)
    payload = {spec.name: codec.encode(torch.zeros(spec.shape)) for spec in syncer.spec.tensors}
    actions = syncer.receive(Update(0, 0, 0, 1, 1, 1, config.codec, payload, step_time_s=bad), 1.0)
    (rejected,) = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]
    assert rejected.reason == RejectReason.BAD_COUNTERS and "step_time_s" in rejected.detail
    assert syncer.step_time.value is None


def test_a_learners_update_carries_the_mean_time_of_its_steps_since_its_last_update():
    config = single_fragment(sync_every=4, overlap_steps=8)
    model = TinyNet(seed=1)
    learner = Learner(config, learner_id=0, model=model, optimizer=sgd(model))
    hub = InProcessHub(config=config, quorum=QuorumConfig(min_quorum=1))
    hub.join(learner)
    updates = []
    for seconds in (0.1, 0.2, 0.3, 0.2, 0.5, 0.5, 0.5, 0.5):
        for update in learner.after_inner_step(4, seconds=seconds):
            updates.append(update)
            hub.send(update)
        hub.advance()
    assert [u.step_time_s for u in updates] == [pytest.approx(0.2), pytest.approx(0.5)]
    other = TinyNet(seed=1)
    untimed = Learner(config, learner_id=1, model=other, optimizer=sgd(other))
    hub.join(untimed)
    assert [u.step_time_s for _ in range(4) for u in untimed.after_inner_step(4)] == [None]
