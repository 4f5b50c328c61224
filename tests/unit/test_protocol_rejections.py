"""Rejected updates and rounds that are not committed: every bad update is rejected with its reason and moves
nothing, and a round whose outer step would not be finite is discarded."""

import dataclasses

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.learner import Learner
from ddiloco.messages import Commit, FragmentState, Rejected, RejectReason, Send
from ddiloco.syncer import MAX_REJECTION_RECORDS, Syncer
from tests.helpers import TinyNet, make_batches, make_system, params_of, publish, single_fragment, train_step


def _valid_update(num_learners=2, **quorum):
    syncer, hub, clock, learners = make_system(
        num_learners, single_fragment(), QuorumConfig(min_quorum=2, grace="none", **quorum))
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
    syncer, hub, clock, (learner, _) = make_system(2, single_fragment(), QuorumConfig(heartbeat_timeout_s=1.0))
    clock.advance_to(10.0)
    hub.advance()                                      # both time out
    assert syncer.alive_learners() == []
    publish(hub, learner, clock, 10.5)
    assert learner.stats.rejections == {"unknown_learner": 1}
    assert learner.joined and syncer.alive_learners() == [0]


def test_non_finite_pseudo_gradient_is_withheld():
    syncer, hub, clock, (learner,) = make_system(1, single_fragment(), QuorumConfig())
    with torch.no_grad():
        next(learner.model.parameters()).fill_(float("nan"))
    assert learner.after_inner_step(tokens=4) == []
    assert learner.stats.updates_withheld_non_finite == 1 and syncer.rounds_committed == 0


def _flood(syncer: Syncer, value: float, *, learner_id: int = 0):
    """An fp32 update of every tensor of fragment 0 filled with `value` (finite, so it passes validation)."""
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
    config = single_fragment(sync_every=2, overlap_steps=1)
    learner = Learner(config, learner_id=0, model=TinyNet(seed=0))
    welcome = FragmentState(0, 0, params_of(TinyNet(seed=1)))
    from ddiloco.messages import Welcome

    learner.receive(Welcome(0, (welcome,), config.fingerprint()))
    (update,) = [u for _ in range(2) for u in learner.after_inner_step(tokens=4)]
    learner.after_inner_step(tokens=4)
    assert not learner.can_step  # tau = 1 step past its publish, no newer version yet
    learner.receive(Rejected(0, 0, update.base_version, RejectReason.NON_FINITE, "not committed"))
    assert learner.can_step
