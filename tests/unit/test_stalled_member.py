"""A live learner that sends no update (a loop that hangs while its heartbeat thread runs, a learner that only
heartbeats) stops counting in the quorum after `QuorumConfig.progress_timeout_s`, and counts again at its next update.

Before: with K = M such a learner held every round open for as long as it lived; the others trained on alone and the
global model never moved again."""

import pytest

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.liveness import STALL_PERIODS, progress_bound
from ddiloco.messages import Heartbeat
from ddiloco.run_config import RunConfig
from tests.helpers import make_system, publish, single_fragment

MAX_WAIT_S = 60.0
"""How long the learners of these tests wait for a round before they train on (`LearnerConfig.max_wait_s`)."""


def tick(hub, clock, learners, at: float, *, training=(0, 1)) -> None:
    """Advance the virtual clock to `at` (the syncer's deadlines included): the learners in `training` take an inner
    step each (one that has waited MAX_WAIT_S for a round trains on, as a learner's driver does) and every learner
    heartbeats."""
    for learner_id in training:
        learner = learners[learner_id]
        clock.advance_to(at)
        hub.advance()
        if not learner.can_step and at - learner.waiting_since >= MAX_WAIT_S:
            learner.stop_waiting()
        if learner.can_step:
            publish(hub, learner, clock, at)
            learner.waiting_since = at
    clock.advance_to(at)
    hub.advance()
    for learner in learners:
        hub.send(Heartbeat(learner.learner_id, learner.inner_step))


def run_with_a_silent_member(quorum: QuorumConfig, *, until: float):
    """Learners 0 and 1 train, a step a second, and learner 2 only heartbeats (its loop hangs), until a round closes
    or `until`; returns (syncer, hub, clock, learners, the time the first round closed or None)."""
    syncer, hub, clock, learners = make_system(3, single_fragment(), quorum)
    for learner in learners:
        learner.waiting_since = 0.0
    t = 0.0
    while syncer.rounds_committed == 0 and t < until:
        t += 1.0
        tick(hub, clock, learners, t)
    closed = hub.round_log[0].closed_at if hub.round_log else None
    return syncer, hub, clock, learners, closed


def test_a_member_without_updates_stops_holding_every_round_at_k_equal_m():
    quorum = QuorumConfig(min_quorum=3, grace="none", heartbeat_timeout_s=5.0)
    syncer, hub, clock, learners, closed = run_with_a_silent_member(quorum, until=2000.0)
    assert closed is not None, "learner 2 heartbeats but never publishes: no round ever closed"
    # Its last progress is its join at t = 0; the bound is the default 600 s (4 periods of a few seconds are less).
    assert closed == pytest.approx(quorum.progress_timeout_s, abs=1.1)
    assert [p.learner_id for p in hub.round_log[0].participants] == [0, 1]
    assert syncer.alive_learners() == [0, 1, 2] and syncer.stalled_learners() == [2]
    assert syncer.effective_quorum() == 2
    # Rounds go on without it, a step apart...
    t = closed
    for _ in range(3):
        t += 1.0
        committed = syncer.rounds_committed
        tick(hub, clock, learners, t)
        assert syncer.rounds_committed == committed + 1
        assert [p.learner_id for p in hub.round_log[-1].participants] == [0, 1]
    # ... until it sends an update: then it counts again, and the rounds after that wait for it.
    t += 1.0
    tick(hub, clock, learners, t, training=(2, 0, 1))
    assert syncer.stalled_learners() == [] and syncer.effective_quorum() == 3
    assert [p.learner_id for p in hub.round_log[-1].participants] == [0, 1, 2]
    committed = syncer.rounds_committed
    tick(hub, clock, learners, t + 1.0)
    assert syncer.rounds_committed == committed
    tick(hub, clock, learners, t + 1.5, training=(2,))
    assert syncer.rounds_committed == committed + 1
    assert [p.learner_id for p in hub.round_log[-1].participants] == [0, 1, 2]


def test_with_the_bound_off_the_member_holds_the_rounds_as_before():
    quorum = QuorumConfig(min_quorum=3, grace="none", heartbeat_timeout_s=5.0, progress_timeout_s=0)
    syncer, _, _, _, closed = run_with_a_silent_member(quorum, until=1000.0)
    assert closed is None and syncer.stalled_learners() == [] and syncer.next_deadline() is not None


def test_the_bound_follows_the_run_s_period_where_that_is_longer():
    # Learners that publish every 30 s, a step each, all three a second apart: a 10 s floor alone would drop each
    # one from the quorum before its own turn; 4 periods of 30 s keep all three in every round.
    quorum = QuorumConfig(min_quorum=3, grace="none", heartbeat_timeout_s=100.0, progress_timeout_s=10.0)
    syncer, hub, clock, learners = make_system(3, single_fragment(), quorum)
    for round_ in range(6):
        for learner in learners:
            publish(hub, learner, clock, 30.0 * round_ + learner.learner_id)
    assert syncer.rounds_committed == 6
    assert all(len(record.participants) == 3 for record in hub.round_log)
    assert syncer.progress_bound() == pytest.approx(STALL_PERIODS * 30.0, rel=0.1)


def test_progress_bound_arithmetic():
    config = DilocoConfig(sync_every=16)
    assert progress_bound(config, QuorumConfig(progress_timeout_s=0), step_time_s=1.0) is None
    assert progress_bound(config, QuorumConfig(progress_timeout_s=600), step_time_s=None) is None
    assert progress_bound(config, QuorumConfig(progress_timeout_s=600), step_time_s=0.5) == 600
    assert progress_bound(config, QuorumConfig(progress_timeout_s=60), step_time_s=2.0) == STALL_PERIODS * 16 * 2.0


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True])
def test_a_bad_progress_timeout_is_refused(value):
    with pytest.raises(ValueError, match="progress_timeout_s"):
        QuorumConfig(progress_timeout_s=value)


def test_a_run_saved_before_the_bound_resumes_without_it():
    saved = RunConfig(num_learners=3).to_dict()
    del saved["quorum"]["progress_timeout_s"]  # as a run of 2026-12-06 wrote it
    assert RunConfig.from_dict(saved).quorum.progress_timeout_s == 0
    assert RunConfig.from_dict({"quorum": {"min_quorum": 2}}).quorum.progress_timeout_s == 600
