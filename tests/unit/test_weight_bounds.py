"""What one learner may claim in a round (issue 13, item 2): tokens per inner step bounded by what it declared at
join and what the run allows, and no learner weighing more than `max_weight_ratio` times the others' mean."""

from __future__ import annotations

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.inprocess import InProcessHub, JoinRefusedError
from ddiloco.learner import Learner
from ddiloco.merge import merge_round, token_weight
from ddiloco.messages import Commit, Join, Refused, RejectReason, Send, Update
from ddiloco.syncer import Syncer, replay_rounds
from tests.helpers import TinyNet, make_batches, make_system, params_of, train_step

CONFIG = DilocoConfig(num_fragments=1, fragment_strategy="single", codec="fp32")
HONEST_STEPS, HONEST_TOKENS_PER_STEP = 8, 128
"""An honest learner's update: 8 inner steps of 128 tokens (weight 8 x 128^2 = 131072)."""


def _syncer(**quorum) -> Syncer:
    # K = 1 with a fixed grace: both updates land in one round, which closes when the grace ends.
    syncer = Syncer(CONFIG, QuorumConfig(min_quorum=1, grace="fixed", grace_s=1.0, **quorum),
                    initial_params=params_of(TinyNet(seed=100)))
    for learner_id in (0, 1):
        syncer.receive(Join(learner_id, syncer.spec, CONFIG.fingerprint()), 0.0)
    return syncer


def _update(syncer: Syncer, learner_id: int, *, scale: float, steps: int, tokens: int, seed: int) -> Update:
    generator = torch.Generator().manual_seed(seed)
    codec = get_codec(CONFIG.codec)
    shapes = {t.name: t.shape for t in syncer.spec.tensors}
    payload = {name: codec.encode(scale * torch.randn(shapes[name], generator=generator))
               for name in syncer.plan.fragments[0]}
    return Update(learner_id, 0, syncer.versions[0], steps, steps, tokens, CONFIG.codec, payload)


def _round(syncer: Syncer, attacker: Update):
    """The honest learner 0 publishes at t = 0, `attacker` (learner 1) at t = 0.5; the round closes by t = 1."""
    honest = _update(syncer, 0, scale=1e-3, steps=HONEST_STEPS, tokens=HONEST_STEPS * HONEST_TOKENS_PER_STEP, seed=0)
    actions = syncer.receive(honest, 0.0) + syncer.receive(attacker, 0.5) + syncer.advance(1.0)
    (commit,) = [a for a in actions if isinstance(a, Commit)]
    return commit.record, actions


def _share_of(record, learner_id: int) -> float:
    total = sum(p.weight for p in record.participants)
    return sum(p.weight for p in record.participants if p.learner_id == learner_id) / total


def _max_change(syncer: Syncer, before: dict[str, torch.Tensor]) -> float:
    return max(float((t - before[n]).abs().max()) for n, t in syncer.global_params().items())


def test_a_learner_claiming_2_53_tokens_in_one_step_does_not_take_the_round():
    # The attack as measured: tokens = 2**53 in steps = 1 weighed 8.1e31 against the honest 1.3e5, so the
    # honest learner's share was ~1e-27 and a pseudo-gradient 1e6 times larger became the global model's step.
    syncer = _syncer()
    before = syncer.global_params()
    attacker = _update(syncer, 1, scale=1e3, steps=1, tokens=2**53, seed=1)
    record, actions = _round(syncer, attacker)
    assert [p.learner_id for p in record.participants] == [0]
    assert _share_of(record, 0) == 1.0
    assert _max_change(syncer, before) < 1e-2  # the honest update alone: values near 1e-3
    (rejection,) = syncer.rejections
    assert rejection.reason == RejectReason.BAD_COUNTERS and rejection.learner_id == 1
    assert f"tokens={2**53}" in rejection.detail and "steps=1" in rejection.detail
    assert str(QuorumConfig().max_tokens_per_step) in rejection.detail
    assert syncer.rejection_counts["bad_counters"] == 1 and syncer.learners[1].rejected == 1
    assert record.rejections == ((1, "bad_counters"),)
    assert any(isinstance(a, Send) and a.learner_id == 1 and getattr(a.message, "reason", None)
               == RejectReason.BAD_COUNTERS for a in actions)


def test_a_learner_at_the_token_bound_gets_at_most_the_capped_share():
    # Within the run's bound (2**24 tokens in one step: weight 2.8e14 against 1.3e5), the claim is accepted
    # but the learner weighs at most max_weight_ratio times the others' mean: share k / (k + 1) of two.
    quorum = QuorumConfig()
    syncer = _syncer()
    initial = params_of(TinyNet(seed=100))
    attacker = _update(syncer, 1, scale=1e-3, steps=1, tokens=quorum.max_tokens_per_step, seed=1)
    record, _ = _round(syncer, attacker)
    k = quorum.max_weight_ratio
    assert [p.learner_id for p in record.participants] == [0, 1]
    honest, claimed = record.participants
    assert honest.weight == token_weight(honest.tokens, honest.steps)
    assert claimed.weight == k * honest.weight  # not token_weight(2**24, 1) = 2.8e14
    assert _share_of(record, 1) == pytest.approx(k / (k + 1), rel=1e-12)
    # The recorded weights are the ones the merge used, and replay needs only the merged tensors.
    deltas = [{n: get_codec(CONFIG.codec).decode(u.payload[n], t.shape) for n, t in initial.items()}
              for u in (_update(syncer, 0, scale=1e-3, steps=HONEST_STEPS,
                                tokens=HONEST_STEPS * HONEST_TOKENS_PER_STEP, seed=0), attacker)]
    expected = merge_round(deltas, [honest.weight, claimed.weight], method=CONFIG.merge,
                           embeddings=syncer.plan.embeddings)
    assert all(torch.equal(record.merged[n], expected[n]) for n in expected)
    replayed = replay_rounds(CONFIG, initial, [record])
    assert all(torch.equal(replayed[n], t) for n, t in syncer.global_params().items())


def test_tokens_above_steps_times_the_declared_bound_are_rejected_naming_the_numbers():
    syncer = Syncer(CONFIG, QuorumConfig(grace="none"), initial_params=params_of(TinyNet(seed=100)))
    learner = Learner(CONFIG, learner_id=0, model=TinyNet(seed=0), max_tokens_per_step=24)  # 4 x 6 targets a batch
    InProcessHub(syncer).join(learner)
    for batch in make_batches(2, seed=0):
        train_step(learner.model, learner.optimizer, batch)
    learner.inner_step, learner.steps_since[0], learner.tokens_since[0] = 2, 2, 49
    before = syncer.global_params()
    syncer.receive(learner._publish(0), 1.0)
    (rejection,) = syncer.rejections
    assert rejection.reason == RejectReason.BAD_COUNTERS
    assert rejection.detail == "tokens=49 in steps=2 is more than the 24 tokens per inner step learner 0 declared"
    assert syncer.rounds_committed == 0
    assert all(torch.equal(before[n], t) for n, t in syncer.global_params().items())
    # At the bound exactly, the update is merged.
    learner.tokens_since[0] = 48
    syncer.receive(learner._publish(0), 1.1)
    assert syncer.rounds_committed == 1 and len(syncer.rejections) == 1


def test_a_learner_that_declares_nothing_is_held_to_the_runs_limit():
    syncer = _syncer(max_tokens_per_step=100)
    ok = _update(syncer, 0, scale=1e-3, steps=2, tokens=200, seed=0)
    over = _update(syncer, 1, scale=1e-3, steps=2, tokens=201, seed=1)
    syncer.receive(ok, 0.0)
    syncer.receive(over, 0.1)
    assert [(r.learner_id, r.reason) for r in syncer.rejections] == [(1, RejectReason.BAD_COUNTERS)]
    assert syncer.rejections[0].detail == ("tokens=201 in steps=2 is more than the 100 tokens per inner step "
                                           "the run allows (max_tokens_per_step)")


def test_a_join_declaring_more_tokens_per_step_than_the_run_allows_is_refused():
    syncer, hub, _, _ = make_system(1, CONFIG, QuorumConfig(max_tokens_per_step=1024))
    with pytest.raises(JoinRefusedError, match=r"learner 1 declares up to 1025 tokens per inner step, but the run "
                                               r"allows at most 1024 \(max_tokens_per_step\)"):
        hub.join(Learner(CONFIG, learner_id=1, model=TinyNet(seed=1), max_tokens_per_step=1025))
    actions = syncer.receive(Join(2, syncer.spec, CONFIG.fingerprint(), max_tokens_per_step=-1), 0.0)
    (refused,) = [a.message for a in actions if isinstance(a.message, Refused)]
    assert "max_tokens_per_step=-1 is invalid" in refused.reason
    assert syncer.alive_learners() == [0]
    hub.join(Learner(CONFIG, learner_id=1, model=TinyNet(seed=1), max_tokens_per_step=1024))
    assert syncer.alive_learners() == [0, 1] and syncer.learners[1].declared_tokens_per_step == 1024


def test_a_learner_refuses_to_count_more_tokens_than_it_declared():
    learner = Learner(CONFIG, learner_id=0, model=TinyNet(seed=0), max_tokens_per_step=24)
    assert learner.join_message().max_tokens_per_step == 24
    learner.joined = True
    learner.after_inner_step(tokens=24)
    with pytest.raises(ValueError, match="tokens=25 is more than the max_tokens_per_step=24 this learner declared"):
        learner.after_inner_step(tokens=25)
    with pytest.raises(ValueError, match="max_tokens_per_step=-1 is invalid: expected an integer >= 0"):
        Learner(CONFIG, learner_id=0, model=TinyNet(seed=0), max_tokens_per_step=-1)


def test_honest_rounds_keep_their_token_weights():
    # Learners of one batch size, some late, some folding a late update into a newer one: no weight is capped.
    config = DilocoConfig(num_fragments=3, sync_every=6, overlap_steps=1, codec="int4")
    syncer, hub, clock, learners = make_system(3, config, QuorumConfig(min_quorum=2, grace="fixed", grace_s=0.05))
    batches = make_batches(30, seed=3)
    for step in range(30):
        for i, learner in enumerate(learners):
            if learner.can_step:
                clock.advance_to(step + 0.1 * i)
                hub.after_inner_step(learner, train_step(learner.model, learner.optimizer, batches[step]))
            else:
                learner.stop_waiting()
    assert syncer.rounds_committed >= 10
    participants = [p for record in hub.round_log for p in record.participants]
    assert all(p.weight == token_weight(p.tokens, p.steps) for p in participants)
