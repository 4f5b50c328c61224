"""Late updates: held for the next round, weighed with the staleness discount, folded with newer work or replaced
by the same work continued, and a learner's last work at the end of a run."""

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import QuorumConfig
from ddiloco.messages import Commit, Rejected, RejectReason, Send
from tests.helpers import FP32, make_batches, make_system, publish, single_fragment, train_step, train_two_steps


def test_late_update_rides_in_the_next_round_without_making_one():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, single_fragment(sync_every=2), quorum)
    # The slow learner publishes from version 0, but its update is still on the way ...
    (late,) = train_two_steps(slow, 9)
    assert late.base_version == 0
    # ... when the fast learner's update closes the round: version 1.
    for t in (0.0, 0.1):
        publish(hub, fast, clock, t)
    assert syncer.versions == [1]
    # One version late, with K = 1 it would be a quorum on its own; it is held for the next round instead.
    actions = syncer.receive(late, now=0.2)
    assert not [a for a in actions if isinstance(a, Commit)] and syncer.versions == [1]
    assert [(h.learner_id, h.base_version) for h in syncer.held_updates()] == [(1, 0)]
    # The fast learner's next update (from version 1) is due: one round, both merged.
    for t in (0.3, 0.4):
        publish(hub, fast, clock, t)
    record = hub.round_log[-1]
    assert record.version == 2 and syncer.rounds_committed == 2
    assert [(q.learner_id, q.staleness) for q in record.participants] == [(0, 0), (1, 1)]


def _fresh_and_late_round(**quorum_fields):
    """The round above: the fast learner's update from version 1 and the slow one's, held, from version 0."""
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0, **quorum_fields)
    syncer, hub, clock, (fast, slow) = make_system(2, single_fragment(sync_every=2), quorum)
    (late,) = train_two_steps(slow, 9)
    for t in (0.0, 0.1):
        publish(hub, fast, clock, t)
    syncer.receive(late, now=0.2)
    for t in (0.3, 0.4):
        publish(hub, fast, clock, t)
    record = hub.round_log[-1]
    assert [(q.learner_id, q.staleness, q.steps) for q in record.participants] == [(0, 0, 2), (1, 1, 2)]
    assert record.participants[0].tokens == record.participants[1].tokens
    return record


def test_a_late_update_weighs_less_with_the_staleness_discount():
    fresh, late = _fresh_and_late_round(staleness_discount=2.0).participants
    assert late.weight == pytest.approx(fresh.weight / 4)       # (1 + 1)^2
    fresh, late = _fresh_and_late_round().participants           # off by default: as a fresh update
    assert late.weight == fresh.weight


def test_the_staleness_discount_must_be_a_finite_number_of_at_least_zero():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="staleness_discount=.* is invalid: expected a finite number >= 0"):
            QuorumConfig(staleness_discount=bad)


def test_a_late_update_waits_for_the_next_due_update_or_for_the_end():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, single_fragment(sync_every=2), quorum)
    in_flight = train_two_steps(slow, 9)
    for t in (0.0, 0.1):
        publish(hub, fast, clock, t)
    hub.leave(fast)
    # The slow learner is alive and will report from version 1: its late update waits for that ...
    syncer.receive(in_flight[0], now=0.2)
    assert syncer.versions == [1] and len(syncer.held_updates()) == 1
    # ... or, if it leaves instead, for nobody: no one alive is left to report.
    hub.leave(slow)
    assert syncer.versions == [2] and syncer.held_updates() == []


def test_the_same_work_continued_replaces_a_held_update():
    quorum = QuorumConfig(min_quorum=2, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (a, b) = make_system(2, single_fragment(sync_every=2, overlap_steps=2), quorum)
    first = []
    for batch in make_batches(5, seed=3):
        first += a.after_inner_step(train_step(a.model, a.optimizer, batch))
        if not a.can_step:
            assert a.stop_waiting() == [0]  # the learner's wait bound passed: it trains on
    assert [u.steps for u in first] == [2, 5]  # the publish due at step 4 waited for the result, then for step 5
    for update in first:
        actions = syncer.receive(update, now=0.5)
        assert not [x for x in actions if isinstance(x, Send) and isinstance(x.message, Rejected)]
    (held,) = syncer.held_updates()
    assert held.inner_step == 5
    # An update with the same base but no more steps is not the same work continued: refused.
    assert [x.message.reason for x in syncer.receive(first[0], now=0.6)
            if isinstance(x, Send) and isinstance(x.message, Rejected)] == [RejectReason.DUPLICATE]


def test_an_update_from_a_newer_base_is_not_mistaken_for_overlap():
    # The slow learner's update (base 0) is late and held; meanwhile it loads version 1 and trains from
    # it. Its update from base 1 is new progress (version 1 overwrote the steps of the held one): the
    # round merges both as one update of that learner, neither is rejected as stale or duplicate.
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, single_fragment(sync_every=2), quorum)
    late = train_two_steps(slow, 9)
    for t in (0.0, 0.1):
        publish(hub, fast, clock, t)                  # version 1, delivered to both learners
    assert slow.versions == [1]
    syncer.receive(late[0], now=0.2)                   # one version late: held for the next round
    assert syncer.versions == [1]
    again = train_two_steps(slow, 10)
    assert again[0].base_version == 1
    actions = syncer.receive(again[0], now=0.3)
    assert not syncer.rejections
    (record,) = [a.record for a in actions if isinstance(a, Commit)]
    assert [(p.learner_id, p.base_version, p.steps) for p in record.participants] == [(1, 1, 4)]
    # The participant names the late update it includes, so every publish has a fate in the round log.
    assert record.participants[0].folded == ((0, late[0].inner_step),)
    decode = get_codec(FP32["codec"]).decode
    for name, merged in record.merged.items():
        shape = merged.shape
        both = decode(late[0].payload[name], shape) + decode(again[0].payload[name], shape)
        torch.testing.assert_close(merged, both, rtol=1e-5, atol=1e-9)  # one update: RDA renormalises it


def test_a_round_that_closes_before_a_learner_published_its_part_takes_that_work_first():
    """The slow learner has trained 3 of its 4 steps on the fragment when the fast learner's round closes:
    applying version 1 would overwrite those 3 steps. It publishes them first (from version 0), skips the
    round it was due to publish at step 4, and the syncer merges the late work into the next round."""
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, single_fragment(sync_every=4, overlap_steps=1), quorum)
    batches = make_batches(3, seed=4)
    for batch in batches:
        assert slow.after_inner_step(train_step(slow.model, slow.optimizer, batch)) == []
    for t in range(4):
        publish(hub, fast, clock, float(t))       # round 0 closes with the fast learner alone
    assert syncer.versions == [1] and slow.versions == [1]
    assert slow.stats.updates_published_early == 1
    (held,) = syncer.held_updates()
    assert (held.learner_id, held.base_version, held.inner_step) == (1, 0, 3)
    # Its step 4 does not publish round 0 again (that work went out at step 3).
    assert slow.after_inner_step(train_step(slow.model, slow.optimizer, make_batches(1, seed=5)[0])) == []
    for t in range(4, 8):
        publish(hub, fast, clock, float(t))
    record = hub.round_log[-1]
    assert record.version == 2
    assert [(q.learner_id, q.steps, q.staleness) for q in record.participants] == [(0, 4, 0), (1, 3, 1)]
    # A learner that already published from its base has nothing to take first: it just applies.
    assert fast.stats.updates_published_early == 0


def test_learners_finishing_together_merge_their_last_work_in_one_round():
    """A learner's last work (`final`) never makes a round: the first finisher's is held until the other
    finishes too (or reports from the current version), so the end of a run is one outer step per
    fragment, not one per learner (K = 1 would close a round on each last update if it counted)."""
    quorum = QuorumConfig(min_quorum=1, grace="fixed", grace_s=0.5, heartbeat_timeout_s=100.0)
    syncer, hub, clock, (a, b) = make_system(2, single_fragment(sync_every=4), quorum)
    for t in range(6):
        publish(hub, a, clock, float(t))
        publish(hub, b, clock, float(t))           # inside a's grace window
    assert syncer.rounds_committed == 1 and len(hub.round_log[0].participants) == 2
    (last_a,) = a.flush()
    assert last_a.final and last_a.steps == 2
    hub.send(last_a)
    hub.leave(a)
    assert syncer.rounds_committed == 1  # held: b is alive and has not finished
    (last_b,) = b.flush()
    hub.send(last_b)                              # everyone alive has given its last work
    assert syncer.rounds_committed == 2
    assert [(q.learner_id, q.steps) for q in hub.round_log[-1].participants] == [(0, 2), (1, 2)]


@pytest.mark.parametrize(("fragments", "sync_every", "moves", "published"), [(1, 1, 1, [0]), (2, 2, 2, [0, 1])])
def test_a_move_of_a_whole_period_publishes_each_fragment_once(fragments, sync_every, moves, published):
    # Late moves of a whole period H (possible where H is a step or two) make a fragment's round due twice after one
    # step. One update carries that work: the second used to send the same work again (the harness's work ledger
    # failed on it at H = 1, tau = 0).
    config = single_fragment(num_fragments=fragments, fragment_strategy="balanced", sync_every=sync_every)
    _, hub, _, (learner,) = make_system(1, config, QuorumConfig(min_quorum=1, grace="none"))
    batches = iter(make_batches(3, seed=0))
    for _ in range(sync_every):
        for update in learner.after_inner_step(train_step(learner.model, learner.optimizer, next(batches))):
            hub.send(update)  # its round closes at once: nothing is owed to the learner when the moves come
    next_round = learner.schedule.next_round
    for _ in range(moves):
        learner.schedule.late()
    updates = learner.after_inner_step(train_step(learner.model, learner.optimizer, next(batches)))
    assert [u.fragment for u in updates] == published
    assert learner.schedule.next_round == next_round + fragments + 1     # the rounds due all count as published


def test_a_fragment_due_again_before_its_result_waits_for_it_and_no_work_is_lost():
    # tau >= H (or a schedule that moved forward) makes a fragment due again while its last update is unanswered.
    # Published again from the same base, the second update was rejected once the first had been merged ("base
    # version 0 overlaps this learner's update from base version 0, already merged"), and the steps between the two
    # publishes were lost: the learner carried only the work after the second onto the round's result.
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, _, (learner,) = make_system(1, single_fragment(sync_every=2, overlap_steps=3), quorum)
    (first,) = train_two_steps(learner, 1)
    assert train_two_steps(learner, 2) == []          # due again, its result still owed: it waits
    assert learner.can_step                             # not blocked yet: 2 steps of 3
    hub.send(first)                                     # the round closes and its result reaches the learner
    assert syncer.versions == [1] and learner.versions == [1]
    (carried,) = train_two_steps(learner, 3)[:1]        # the first step after the result publishes what waited
    assert (carried.base_version, carried.steps) == (1, 3), (carried.base_version, carried.steps)
    hub.send(carried)
    assert syncer.versions == [2] and not learner.stats.rejections
    assert hub.round_log[-1].participants[0].steps == 3  # the two steps trained while waiting and one after
