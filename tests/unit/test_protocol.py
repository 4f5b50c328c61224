"""The learner and syncer cores together, driven in-process on a virtual clock."""

import dataclasses

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.inprocess import JoinRefusedError
from ddiloco.learner import Learner
from ddiloco.messages import Commit, FragmentState, Rejected, RejectReason, Send
from ddiloco.syncer import MAX_REJECTION_RECORDS, Syncer, replay_rounds
from tests.helpers import TinyNet, make_batches, make_system, params_of, train_step

FP32 = dict(codec="fp32", downlink_codec="fp32")
"""Exact both ways: for tests that compare with arithmetic written out by hand."""


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_one_learner_with_identity_outer_step_equals_local_training():
    config = DilocoConfig(num_fragments=1, fragment_strategy="single", sync_every=1, overlap_steps=0,
                          merge="mean", outer_lr=1.0, outer_momentum=0.0, **FP32)
    syncer, hub, _, (learner,) = make_system(1, config, QuorumConfig(min_quorum=1, grace="none"),
                                             optimizer=adamw)
    reference = TinyNet(seed=100)
    reference_opt = adamw(reference)
    for batch in make_batches(20, seed=3):
        assert learner.can_step
        tokens = train_step(learner.model, learner.optimizer, batch)
        hub.after_inner_step(learner, tokens)
        train_step(reference, reference_opt, batch)
    assert syncer.rounds_committed == 20
    for name, expected in params_of(reference).items():
        torch.testing.assert_close(dict(learner.model.named_parameters())[name].detach(), expected,
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(syncer.global_params()[name], expected, atol=1e-6, rtol=0)


def test_full_quorum_equal_speeds_reduces_to_synchronous_streaming_diloco():
    lr, mu, num, sync_every = 0.7, 0.9, 3, 4
    config = DilocoConfig(num_fragments=2, sync_every=sync_every, overlap_steps=0, merge="mean",
                          outer_lr=lr, outer_momentum=mu, **FP32)
    syncer, hub, _, learners = make_system(num, config, QuorumConfig(min_quorum=num, grace="none"),
                                           optimizer=adamw)
    plan = syncer.plan
    # Reference: streaming DiLoCo written out by hand.
    global_ = params_of(TinyNet(seed=100))
    momentum = {name: torch.zeros_like(t) for name, t in global_.items()}
    models = [TinyNet(seed=100) for _ in range(num)]
    optimizers = [adamw(m) for m in models]
    batches = [make_batches(16, seed=10 + i) for i in range(num)]
    next_round = 0
    for step in range(16):
        for i in range(num):
            assert learners[i].can_step
            hub.after_inner_step(learners[i], train_step(learners[i].model, learners[i].optimizer,
                                                         batches[i][step]))
            train_step(models[i], optimizers[i], batches[i][step])
        while (next_round // 2) * sync_every + ((next_round % 2) + 1) * sync_every // 2 <= step + 1:
            for name in plan.fragments[next_round % 2]:
                local = [dict(m.named_parameters())[name].detach() for m in models]
                delta = sum(global_[name] - t for t in local) / num
                momentum[name] = mu * momentum[name] + delta
                global_[name] = global_[name] - lr * (delta + mu * momentum[name])
                with torch.no_grad():
                    for m in models:
                        dict(m.named_parameters())[name].copy_(global_[name])
            next_round += 1
    assert syncer.rounds_committed == next_round == 8
    for name, expected in global_.items():
        torch.testing.assert_close(syncer.global_params()[name], expected, atol=1e-6, rtol=0)
        for learner, model in zip(learners, models, strict=True):
            torch.testing.assert_close(dict(learner.model.named_parameters())[name].detach(),
                                       dict(model.named_parameters())[name].detach(), atol=1e-6, rtol=0)


def _publish(hub, learner, clock, at):
    """Advance the virtual clock to `at`, then train one inner step of `learner` and publish."""
    clock.advance_to(at)
    hub.advance()
    batch = make_batches(1, seed=learner.learner_id * 100 + learner.inner_step)[0]
    hub.after_inner_step(learner, train_step(learner.model, learner.optimizer, batch))


def _single_fragment(**overrides):
    fields = dict(num_fragments=1, fragment_strategy="single", sync_every=1, overlap_steps=8, **FP32)
    return DilocoConfig(**(fields | overrides))


def test_round_closes_on_quorum_merges_inside_grace_and_defers_later_updates():
    quorum = QuorumConfig(min_quorum=2, grace="fixed", grace_s=1.0, heartbeat_timeout_s=100.0)
    syncer, hub, clock, learners = make_system(4, _single_fragment(), quorum)
    _publish(hub, learners[0], clock, 0.0)
    assert syncer.rounds_committed == 0
    _publish(hub, learners[1], clock, 0.5)          # quorum: grace until 1.5
    assert syncer.rounds_committed == 0 and syncer.next_deadline() == 1.5
    _publish(hub, learners[2], clock, 1.0)          # inside the grace window
    clock.advance_to(1.5)
    hub.advance()
    (first,) = hub.round_log
    assert [p.learner_id for p in first.participants] == [0, 1, 2]
    assert (first.quorum_at, first.closed_at, first.grace_s) == (0.5, 1.5, 1.0)
    # Learner 3 never reported and was not waited for, yet it holds the new version.
    assert learners[3].versions == [1]
    _publish(hub, learners[0], clock, 2.0)
    _publish(hub, learners[1], clock, 2.1)
    clock.advance_to(3.1)
    hub.advance()
    assert [p.learner_id for p in hub.round_log[1].participants] == [0, 1]


def test_late_update_rides_in_the_next_round_without_making_one():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, _single_fragment(sync_every=2), quorum)
    # The slow learner publishes from version 0, but its update is still on the way ...
    in_flight = []
    for batch in make_batches(2, seed=9):
        in_flight += slow.after_inner_step(train_step(slow.model, slow.optimizer, batch))
    (late,) = in_flight
    assert late.base_version == 0
    # ... when the fast learner's update closes the round: version 1.
    for t in (0.0, 0.1):
        _publish(hub, fast, clock, t)
    assert syncer.versions == [1]
    # One version late, with K = 1 it would be a quorum on its own; it is held for the next round instead.
    actions = syncer.receive(late, now=0.2)
    assert not [a for a in actions if isinstance(a, Commit)] and syncer.versions == [1]
    assert [(h.learner_id, h.base_version) for h in syncer.held_updates()] == [(1, 0)]
    # The fast learner's next update (from version 1) is due: one round, both merged.
    for t in (0.3, 0.4):
        _publish(hub, fast, clock, t)
    record = hub.round_log[-1]
    assert record.version == 2 and syncer.rounds_committed == 2
    assert [(q.learner_id, q.staleness) for q in record.participants] == [(0, 0), (1, 1)]


def _train_two_steps(learner, seed):
    """Two inner steps of `learner` (sync_every = 2: one update); returns what it published."""
    updates = []
    for batch in make_batches(2, seed=seed):
        updates += learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
    return updates


def test_a_round_result_names_the_learners_it_merged_on_time():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, _, _, (fast, slow) = make_system(2, _single_fragment(sync_every=2), quorum)

    def broadcasts(actions):
        return [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, FragmentState)]

    (late,) = _train_two_steps(slow, 9)                                   # from version 0, still on its way
    (first,) = _train_two_steps(fast, 8)
    sent = broadcasts(syncer.receive(first, now=0.1))            # K = 1: closes version 1 alone
    assert [(m.version, m.on_time) for m in sent] == [(1, (0,)), (1, (0,))]
    fast.receive(sent[0])
    syncer.receive(late, now=0.2)                                # after the close: held for the next round
    (second,) = _train_two_steps(fast, 7)
    actions = syncer.receive(second, now=0.3)
    # Both merged into version 2, but only the fast learner's update was from version 1: the slow one was late.
    (commit,) = [a for a in actions if isinstance(a, Commit)]
    assert [(q.learner_id, q.staleness) for q in commit.record.participants] == [(0, 0), (1, 1)]
    assert [(m.version, m.on_time) for m in broadcasts(actions)] == [(2, (0,)), (2, (0,))]


@pytest.mark.parametrize(("grace_s", "margins"), [(3.0, (3.0, 2.0)), (1.9, (2.05, 1.3 / 1.125))])
def test_a_round_result_says_how_much_of_the_grace_window_each_on_time_learner_had_left(grace_s, margins):
    # A fixed window from the quorum (K = 1: the first update). Margins are in each learner's own step time,
    # measured between its updates, so the first round, with no step time yet, reports none. A window shorter
    # than round_margin_steps (1.5 here) + 0.5 average steps (1.025 s here: 2.05 s) counts as that long: the
    # learner that made the quorum keeps 2.05 of its steps, the one 0.75 s behind it falls short of 1.5.
    quorum = QuorumConfig(min_quorum=1, grace="fixed", grace_s=grace_s, heartbeat_timeout_s=100.0)
    syncer, _, _, (fast, slow) = make_system(2, _single_fragment(sync_every=2, round_margin_steps=1.5), quorum)

    def result_of(actions):
        states = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, FragmentState)]
        state = states[0]
        assert len(states) == 2 and all(s is state for s in states)          # one broadcast, to both
        for learner in (fast, slow):
            learner.receive(state)
        return state

    (update,) = _train_two_steps(fast, 8)
    assert not [a for a in syncer.receive(update, now=0.0) if isinstance(a, Commit)]   # window open
    (update,) = _train_two_steps(slow, 9)
    first = result_of(syncer.receive(update, now=0.5))       # everyone reported: closes at once
    assert (first.on_time, first.margins) == ((0, 1), None)
    (update,) = _train_two_steps(fast, 7)
    syncer.receive(update, now=2.0)                           # 1.0 s per step; window until 2.0 + grace_s
    (update,) = _train_two_steps(slow, 6)
    second = result_of(syncer.receive(update, now=2.75))      # 1.125 s per step, arrived 0.75 s later
    assert second.on_time == (0, 1)
    assert second.margins == (None if margins is None else pytest.approx(margins))


def test_a_round_without_a_grace_window_reports_no_margins():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, _, _, (learner,) = make_system(1, _single_fragment(sync_every=2), quorum)
    for round_index in range(3):
        updates = []
        for batch in make_batches(2, seed=round_index):
            updates += learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
        (update,) = updates
        (state,) = [a.message for a in syncer.receive(update, now=float(round_index))
                    if isinstance(a, Send) and isinstance(a.message, FragmentState)]
        learner.receive(state)
        assert state.on_time == (0,) and state.margins is None


def _fresh_and_late_round(**quorum_fields):
    """The round above: the fast learner's update from version 1 and the slow one's, held, from version 0."""
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0, **quorum_fields)
    syncer, hub, clock, (fast, slow) = make_system(2, _single_fragment(sync_every=2), quorum)
    in_flight = []
    for batch in make_batches(2, seed=9):
        in_flight += slow.after_inner_step(train_step(slow.model, slow.optimizer, batch))
    (late,) = in_flight
    for t in (0.0, 0.1):
        _publish(hub, fast, clock, t)
    syncer.receive(late, now=0.2)
    for t in (0.3, 0.4):
        _publish(hub, fast, clock, t)
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
    syncer, hub, clock, (fast, slow) = make_system(2, _single_fragment(sync_every=2), quorum)
    in_flight = []
    for batch in make_batches(2, seed=9):
        in_flight += slow.after_inner_step(train_step(slow.model, slow.optimizer, batch))
    for t in (0.0, 0.1):
        _publish(hub, fast, clock, t)
    hub.leave(fast)
    # The slow learner is alive and will report from version 1: its late update waits for that ...
    syncer.receive(in_flight[0], now=0.2)
    assert syncer.versions == [1] and len(syncer.held_updates()) == 1
    # ... or, if it leaves instead, for nobody: no one alive is left to report.
    hub.leave(slow)
    assert syncer.versions == [2] and syncer.held_updates() == []


def test_the_same_work_continued_replaces_a_held_update():
    quorum = QuorumConfig(min_quorum=2, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (a, b) = make_system(2, _single_fragment(sync_every=2), quorum)
    first = []
    for batch in make_batches(4, seed=3):
        first += a.after_inner_step(train_step(a.model, a.optimizer, batch))
    assert [u.steps for u in first] == [2, 4]  # the learner's wait bound passed: it trained on
    for update in first:
        actions = syncer.receive(update, now=0.5)
        assert not [x for x in actions if isinstance(x, Send) and isinstance(x.message, Rejected)]
    (held,) = syncer.held_updates()
    assert held.inner_step == 4
    # An update with the same base but no more steps is not the same work continued: refused.
    assert [x.message.reason for x in syncer.receive(first[0], now=0.6)
            if isinstance(x, Send) and isinstance(x.message, Rejected)] == [RejectReason.DUPLICATE]


def test_a_failed_learner_is_never_waited_for():
    quorum = QuorumConfig(min_quorum=3, grace="none", heartbeat_timeout_s=5.0)
    syncer, hub, clock, learners = make_system(3, _single_fragment(), quorum)
    _publish(hub, learners[0], clock, 1.0)
    _publish(hub, learners[1], clock, 2.0)
    assert syncer.rounds_committed == 0
    # Learner 2 is silent: once its heartbeat times out the effective quorum drops to 2.
    assert syncer.next_deadline() == pytest.approx(5.0)
    clock.advance_to(5.01)
    hub.advance()
    assert syncer.rounds_committed == 1 and syncer.alive_learners() == [0, 1]
    # A learner that says it leaves is not waited for either (learner 0 last spoke at 1.0: 5.9 is
    # inside its heartbeat timeout).
    _publish(hub, learners[0], clock, 5.9)
    hub.leave(learners[1])
    assert syncer.rounds_committed == 2


def test_quorum_larger_than_the_learners_never_deadlocks():
    quorum = QuorumConfig(min_quorum=8, grace="none")
    syncer, hub, clock, learners = make_system(2, _single_fragment(), quorum)
    _publish(hub, learners[0], clock, 0.0)
    _publish(hub, learners[1], clock, 0.1)
    assert syncer.rounds_committed == 1


def test_adaptive_grace_follows_the_formula():
    config = _single_fragment(overlap_steps=2)
    syncer = Syncer(config, QuorumConfig(grace="adaptive", grace_gamma=1.0),
                    initial_params=params_of(TinyNet()))
    assert syncer.grace_window() == 0.0                       # no estimate yet: never delay
    syncer.step_time.value, syncer.quorum_time.value, syncer.sync_time.value = 1.0, 0.3, 0.2
    assert syncer.grace_window() == pytest.approx(1.0)        # clip(2 - 0.3 - 0.2, 0, 1)
    syncer.quorum_time.value = 1.6
    assert syncer.grace_window() == pytest.approx(0.2)        # 2 - 1.6 - 0.2
    syncer.quorum_time.value = 3.0
    assert syncer.grace_window() == 0.0


def test_the_adaptive_grace_cap_is_grace_max_steps_and_at_most_tau_minus_one_steps():
    def grace(tau, **quorum):
        syncer = Syncer(_single_fragment(overlap_steps=tau), QuorumConfig(grace="adaptive", **quorum),
                        initial_params=params_of(TinyNet()))
        syncer.step_time.value, syncer.quorum_time.value, syncer.sync_time.value = 1.0, 0.3, 0.2
        return syncer.grace_window()

    assert QuorumConfig().grace_max_steps == 2.0 and DilocoConfig().overlap_steps == 3
    assert grace(3) == pytest.approx(2.0)                             # the defaults: clip(3 - 0.5, 0, 2)
    assert grace(3, grace_gamma=0.6) == pytest.approx(1.5)            # 0.6 x 2.5, under the cap
    assert grace(8, grace_max_steps=4.5) == pytest.approx(4.5)
    assert grace(3, grace_max_steps=5.0) == pytest.approx(2.0)        # never above tau - 1 steps
    assert grace(2) == pytest.approx(1.0)                             # tau = 2: the paper's one step
    assert grace(1) == pytest.approx(0.5)                             # the slack itself, 1 - 0.5


def test_step_time_is_estimated_from_update_arrivals():
    quorum = QuorumConfig(min_quorum=1, grace="adaptive", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (learner,) = make_system(1, _single_fragment(), quorum)
    for t in (0.0, 0.5, 1.0, 1.5):
        _publish(hub, learner, clock, t)
    assert syncer.step_time.value == pytest.approx(0.5)


def _valid_update(num_learners=2, **quorum):
    syncer, hub, clock, learners = make_system(
        num_learners, _single_fragment(), QuorumConfig(min_quorum=2, grace="none", **quorum))
    learner = learners[0]
    train_step(learner.model, learner.optimizer, make_batches(1, seed=5)[0])
    learner.inner_step += 1
    learner.steps_since[0] += 1
    learner.tokens_since[0] += 24
    return syncer, hub, learners, learner._publish(0)


def _nan_bytes(update):
    return {name: torch.full((len(data) // 4,), float("nan")).numpy().tobytes()
            for name, data in update.payload.items()}


CORRUPTIONS = {
    RejectReason.UNKNOWN_LEARNER: lambda u: dataclasses.replace(u, learner_id=99),
    RejectReason.BAD_FRAGMENT: lambda u: dataclasses.replace(u, fragment=3),
    RejectReason.WRONG_CODEC: lambda u: dataclasses.replace(u, codec="bf16"),
    RejectReason.WRONG_TENSORS: lambda u: dataclasses.replace(u, payload=dict(list(u.payload.items())[1:])),
    RejectReason.MALFORMED: lambda u: dataclasses.replace(
        u, payload={n: d[:-4] for n, d in u.payload.items()}),
    RejectReason.NON_FINITE: lambda u: dataclasses.replace(u, payload=_nan_bytes(u)),
    RejectReason.BAD_COUNTERS: lambda u: dataclasses.replace(u, steps=0),
}


@pytest.mark.parametrize("reason", list(CORRUPTIONS))
def test_every_bad_update_is_rejected_with_its_reason_and_moves_nothing(reason):
    syncer, _, _, update = _valid_update()
    before = syncer.global_params()
    actions = syncer.receive(CORRUPTIONS[reason](update), now=1.0)
    assert [r.reason for r in syncer.rejections] == [reason]
    assert any(isinstance(a, Send) and isinstance(a.message, Rejected) and a.message.reason == reason
               for a in actions)
    assert all(torch.equal(before[n], t) for n, t in syncer.global_params().items())
    assert syncer.rounds_committed == 0


def test_rejection_records_keep_the_newest_and_the_counts_stay_exact():
    syncer, _, _, update = _valid_update()
    bad = dataclasses.replace(update, fragment=3)
    for i in range(5000):
        syncer.receive(dataclasses.replace(bad, inner_step=update.inner_step + i), now=float(i))
    assert len(syncer.rejections) == MAX_REJECTION_RECORDS < 5000
    assert syncer.rejections[-1].time == 4999.0 and syncer.rejections[0].time == 5000.0 - MAX_REJECTION_RECORDS
    assert syncer.rejection_counts == {"bad_fragment": 5000}
    assert syncer.learners[0].rejected == 5000


def test_duplicate_and_stale_updates_are_rejected():
    syncer, _, learners, update = _valid_update()
    syncer.receive(update, now=1.0)
    syncer.receive(update, now=1.1)
    assert [r.reason for r in syncer.rejections] == [RejectReason.DUPLICATE]
    # Close the round with the second learner, then replay the first update: it now overlaps a
    # contribution already merged, so it is stale (and the learner is sent the current fragment).
    other = learners[1]
    other.inner_step, other.steps_since[0], other.tokens_since[0] = 1, 1, 24
    syncer.receive(other._publish(0), now=1.2)
    assert syncer.rounds_committed == 1
    actions = syncer.receive(update, now=1.3)
    assert syncer.rejections[-1].reason == RejectReason.STALE
    assert any(isinstance(a.message, FragmentState) for a in actions)


def test_too_stale_updates_are_rejected():
    syncer, _, _, update = _valid_update(num_learners=1, max_staleness=0)
    syncer.versions[0] = 1
    syncer.receive(update, now=1.0)
    assert syncer.rejections[-1].reason == RejectReason.STALE
    assert "1 versions behind" in syncer.rejections[-1].detail


def test_unknown_learner_rejection_makes_the_learner_join_again():
    syncer, hub, clock, (learner, _) = make_system(2, _single_fragment(), QuorumConfig(heartbeat_timeout_s=1.0))
    clock.advance_to(10.0)
    hub.advance()                                      # both time out
    assert syncer.alive_learners() == []
    _publish(hub, learner, clock, 10.5)
    assert learner.stats.rejections == {"unknown_learner": 1}
    assert learner.joined and syncer.alive_learners() == [0]


def test_replaying_the_round_log_reproduces_the_global_state_bit_for_bit():
    config = DilocoConfig(num_fragments=3, sync_every=6, overlap_steps=1, codec="int4")
    syncer, hub, clock, learners = make_system(3, config, QuorumConfig(min_quorum=2, grace="fixed", grace_s=0.05),
                                               optimizer=adamw)
    initial = params_of(TinyNet(seed=100))
    for step in range(30):
        for i, learner in enumerate(learners):
            if learner.can_step:
                _publish(hub, learner, clock, step + 0.1 * i)
            else:
                learner.stop_waiting()
    assert syncer.rounds_committed >= 10
    replayed = replay_rounds(config, initial, hub.round_log)
    for name, tensor in syncer.global_params().items():
        assert torch.equal(replayed[name], tensor), name


def test_join_refusals_name_the_mismatch():
    config = _single_fragment()
    syncer, hub, _, _ = make_system(1, config)
    before = syncer.global_params()
    wide = TinyNet(width=4)
    with pytest.raises(JoinRefusedError, match="model differs.*token_embedding.weight"):
        hub.join(Learner(config, learner_id=5, model=wide))
    other = _single_fragment(outer_lr=0.5)
    with pytest.raises(JoinRefusedError, match="algorithm config differs"):
        hub.join(Learner(other, learner_id=6, model=TinyNet()))
    assert all(torch.equal(before[n], t) for n, t in syncer.global_params().items())
    assert syncer.alive_learners() == [0]


def test_a_learner_never_trains_before_joining_and_its_init_never_becomes_global():
    config = _single_fragment()
    model = TinyNet(seed=7)
    learner = Learner(config, learner_id=0, model=model)
    assert not learner.can_step
    with pytest.raises(RuntimeError, match="before joining"):
        learner.after_inner_step(tokens=1)
    syncer, hub, _, _ = make_system(0, config)
    global_before = syncer.global_params()
    hub.join(learner)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), global_before[name])
    assert all(torch.equal(global_before[n], t) for n, t in syncer.global_params().items())


def test_waiting_rule_blocks_after_tau_steps_and_can_be_abandoned():
    config = _single_fragment(sync_every=4, overlap_steps=2)
    syncer, hub, clock, (learner, _) = make_system(2, config, QuorumConfig(min_quorum=2, grace="none"))
    for t in range(4):
        _publish(hub, learner, clock, float(t))     # publishes at inner step 4
    assert learner.can_step
    _publish(hub, learner, clock, 4.0)
    assert learner.can_step                         # inner step 5 < 4 + 2
    _publish(hub, learner, clock, 5.0)
    assert not learner.can_step and learner.blocking_fragments() == [0]
    assert learner.stop_waiting() == [0] and learner.can_step
    assert learner.stats.waits_abandoned == 1


def test_applying_a_fragment_keeps_optimizer_state_and_resets_counters():
    config = DilocoConfig(num_fragments=2, sync_every=2, overlap_steps=4, **FP32)
    syncer, hub, clock, (learner,) = make_system(1, config, QuorumConfig(grace="none"), optimizer=adamw)
    _publish(hub, learner, clock, 0.0)                        # round 0 (fragment 0) due at step 1
    state_ids = {id(s["exp_avg"]) for s in learner.optimizer.state.values()}
    assert syncer.versions == [1, 0] and learner.versions == [1, 0]
    assert learner.steps_since == [0, 1] and learner.tokens_since == [0, 24]
    assert {id(s["exp_avg"]) for s in learner.optimizer.state.values()} == state_ids
    assert all(s["step"] == 1 for s in learner.optimizer.state.values())


def test_after_each_round_every_learner_holds_the_syncer_fragment():
    config = DilocoConfig(num_fragments=2, sync_every=4, overlap_steps=0, **FP32)
    syncer, hub, clock, learners = make_system(3, config, QuorumConfig(min_quorum=3, grace="none"))
    for step in range(8):
        for learner in learners:
            committed = syncer.rounds_committed
            _publish(hub, learner, clock, float(step))
            if syncer.rounds_committed > committed:
                p = hub.round_log[-1].fragment
                global_ = syncer.global_params()
                for other in learners:
                    assert other.versions[p] == syncer.versions[p]
                    params = dict(other.model.named_parameters())
                    for name in syncer.plan.fragments[p]:
                        assert torch.equal(params[name].detach(), global_[name])


def test_non_finite_pseudo_gradient_is_withheld():
    syncer, hub, clock, (learner,) = make_system(1, _single_fragment(), QuorumConfig())
    with torch.no_grad():
        next(learner.model.parameters()).fill_(float("nan"))
    assert learner.after_inner_step(tokens=4) == []
    assert learner.stats.updates_withheld_non_finite == 1 and syncer.rounds_committed == 0


def test_syncer_state_dict_round_trip():
    config = DilocoConfig(num_fragments=2, sync_every=2, overlap_steps=4, **FP32)
    syncer, hub, clock, (learner,) = make_system(1, config, QuorumConfig(grace="none"))
    for t in range(6):
        _publish(hub, learner, clock, float(t))
    restored = Syncer(config, QuorumConfig(grace="none"), initial_params=params_of(TinyNet(seed=3)))
    restored.load_state_dict(syncer.state_dict())
    assert restored.versions == syncer.versions and restored.rounds_committed == syncer.rounds_committed
    assert all(torch.equal(restored.global_params()[n], t) for n, t in syncer.global_params().items())
    assert restored.alive_learners() == []  # learners must join a restored syncer again


def test_round_closes_early_once_every_live_learner_has_reported():
    quorum = QuorumConfig(min_quorum=1, grace="fixed", grace_s=5.0, heartbeat_timeout_s=100.0)
    syncer, hub, clock, (first, second) = make_system(2, _single_fragment(), quorum)
    _publish(hub, first, clock, 1.0)
    assert syncer.rounds_committed == 0 and syncer.next_deadline() == 6.0
    _publish(hub, second, clock, 2.0)               # nobody left to wait for: no need for the grace
    assert syncer.rounds_committed == 1 and hub.round_log[0].closed_at == 2.0


def test_an_update_from_a_newer_base_is_not_mistaken_for_overlap():
    # The slow learner's update (base 0) is late and held; meanwhile it loads version 1 and trains from
    # it. Its update from base 1 is new progress (version 1 overwrote the steps of the held one): the
    # round merges both as one update of that learner, neither is rejected as stale or duplicate.
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, _single_fragment(sync_every=2), quorum)
    def train_two_steps(seed):
        batches = make_batches(2, seed=seed)
        return [u for b in batches for u in slow.after_inner_step(train_step(slow.model, slow.optimizer, b))]

    late = train_two_steps(9)
    for t in (0.0, 0.1):
        _publish(hub, fast, clock, t)                  # version 1, delivered to both learners
    assert slow.versions == [1]
    syncer.receive(late[0], now=0.2)                   # one version late: held for the next round
    assert syncer.versions == [1]
    again = train_two_steps(10)
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


def test_advancing_exactly_at_the_deadline_times_a_silent_learner_out():
    syncer, hub, clock, _ = make_system(2, _single_fragment(), QuorumConfig(heartbeat_timeout_s=5.0))
    deadline = syncer.next_deadline()
    clock.advance_to(deadline)
    hub.advance()
    assert syncer.alive_learners() == [] and syncer.next_deadline() is None


def test_a_rejoin_keeps_work_on_current_fragments_and_publishes_a_lost_update_again():
    """A syncer restarted with the round open lost the learner's update: the Welcome brings the very
    version the learner published from, so the learner keeps its local work on that fragment and
    publishes it again at once (with K = M the others' round waits for exactly that update)."""
    config = _single_fragment(sync_every=4, overlap_steps=2)
    syncer, hub, clock, (learner, _) = make_system(2, config, QuorumConfig(min_quorum=2, grace="none"))
    for t in range(4):
        _publish(hub, learner, clock, float(t))       # publishes fragment 0 from version 0 at inner step 4
    assert syncer.rounds_committed == 0 and learner.blocking_fragments() == []
    local = params_of(learner.model)
    restarted = Syncer(config, QuorumConfig(min_quorum=2, grace="none"), initial_params=syncer.global_params())
    welcome = next(a.message for a in restarted.receive(learner.join_message(), 5.0) if isinstance(a, Send))
    replies = learner.receive(welcome)
    assert [(u.fragment, u.base_version, u.inner_step, u.steps) for u in replies] == [(0, 0, 4, 4)]
    for name, value in params_of(learner.model).items():
        assert torch.equal(value, local[name]), f"{name}: the re-join threw local work away"
    # A Welcome with a newer version replaces the fragment as before.
    newer = FragmentState(0, 3, syncer.global_params())
    learner.receive(dataclasses.replace(welcome, fragments=(newer,)))
    for name, value in params_of(learner.model).items():
        assert torch.equal(value, syncer.global_params()[name])
    assert learner.versions == [3] and learner.can_step


def _flood(syncer: Syncer, value: float, *, learner_id: int = 0):
    """An fp32 update of every tensor of fragment 0 filled with `value` (finite, so it passes validation)."""
    from ddiloco.compression import get_codec
    from ddiloco.messages import Join, Update

    codec = get_codec("fp32")
    if learner_id not in syncer.learners:
        syncer.receive(Join(learner_id, syncer.spec, syncer.config.fingerprint()), 0.0)
    shapes = {t.name: t.shape for t in syncer.spec.tensors}
    payload = {name: codec.encode(torch.full(shapes[name], value)) for name in syncer.plan.fragments[0]}
    return syncer.receive(Update(learner_id, 0, 0, 2, 2, 10, "fp32", payload), 1.0)


def test_finite_updates_whose_norm_overflows_float32_still_merge_to_a_finite_round():
    # Values near 1e20 square past float32's range: a float32 norm is inf, RDA's mean norm becomes inf
    # and the committed round held inf and NaN. Norms in float64 keep it finite (and not zero).
    config = DilocoConfig(num_fragments=1, fragment_strategy="single", codec="fp32")
    syncer = Syncer(config, QuorumConfig(min_quorum=2, grace="none"), initial_params=params_of(TinyNet(seed=100)))
    from ddiloco.messages import Join

    for learner_id in (0, 1):
        syncer.receive(Join(learner_id, syncer.spec, config.fingerprint()), 0.0)
    assert not [a for a in _flood(syncer, 1e-3, learner_id=0) if isinstance(a, Commit)]  # waits for the quorum
    actions = _flood(syncer, 1e20, learner_id=1)
    (commit,) = [a for a in actions if isinstance(a, Commit)]
    assert all(bool(torch.isfinite(t).all()) and bool(t.abs().max() > 1e18) for t in commit.record.merged.values())
    assert all(bool(torch.isfinite(t).all()) for t in syncer.global_params().values())


def test_a_round_whose_outer_step_would_not_be_finite_is_not_committed_and_its_updates_are_rejected():
    config = DilocoConfig(num_fragments=1, fragment_strategy="single", codec="fp32")
    syncer = Syncer(config, QuorumConfig(grace="none"), initial_params=params_of(TinyNet(seed=100)))
    before = syncer.global_params()
    actions = _flood(syncer, 3e38)  # finite, but theta - lr * (delta + mu * m) overflows float32
    assert not [a for a in actions if isinstance(a, Commit)]
    (rejected,) = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]
    assert rejected.reason == RejectReason.NON_FINITE and "not committed" in rejected.detail
    assert syncer.rounds_committed == 0 and syncer.versions == [0] and syncer.held_updates() == []
    assert all(torch.equal(before[n], t) for n, t in syncer.global_params().items())
    assert syncer.rejection_counts["non_finite"] == 1


def test_a_rejected_update_ends_the_wait_for_its_round():
    config = _single_fragment(sync_every=2, overlap_steps=1)
    learner = Learner(config, learner_id=0, model=TinyNet(seed=0))
    welcome = FragmentState(0, 0, params_of(TinyNet(seed=1)))
    from ddiloco.messages import Welcome

    learner.receive(Welcome(0, (welcome,), config.fingerprint()))
    (update,) = [u for _ in range(2) for u in learner.after_inner_step(tokens=4)]
    learner.after_inner_step(tokens=4)
    assert not learner.can_step  # tau = 1 step past its publish, no newer version yet
    learner.receive(Rejected(0, 0, update.base_version, RejectReason.NON_FINITE, "not committed"))
    assert learner.can_step


def test_a_round_that_closes_before_a_learner_published_its_part_takes_that_work_first():
    """The slow learner has trained 3 of its 4 steps on the fragment when the fast learner's round closes:
    applying version 1 would overwrite those 3 steps. It publishes them first (from version 0), skips the
    round it was due to publish at step 4, and the syncer merges the late work into the next round."""
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (fast, slow) = make_system(2, _single_fragment(sync_every=4, overlap_steps=1), quorum)
    batches = make_batches(3, seed=4)
    for batch in batches:
        assert slow.after_inner_step(train_step(slow.model, slow.optimizer, batch)) == []
    for t in range(4):
        _publish(hub, fast, clock, float(t))       # round 0 closes with the fast learner alone
    assert syncer.versions == [1] and slow.versions == [1]
    assert slow.stats.updates_published_early == 1
    (held,) = syncer.held_updates()
    assert (held.learner_id, held.base_version, held.inner_step) == (1, 0, 3)
    # Its step 4 does not publish round 0 again (that work went out at step 3).
    assert slow.after_inner_step(train_step(slow.model, slow.optimizer, make_batches(1, seed=5)[0])) == []
    for t in range(4, 8):
        _publish(hub, fast, clock, float(t))
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
    syncer, hub, clock, (a, b) = make_system(2, _single_fragment(sync_every=4), quorum)
    for t in range(6):
        _publish(hub, a, clock, float(t))
        _publish(hub, b, clock, float(t))           # inside a's grace window
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
