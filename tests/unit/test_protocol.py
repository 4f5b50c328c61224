"""The learner and syncer cores together, driven in-process on a virtual clock: references, invariants, joins,
state (by topic: rounds and quorum `test_protocol_rounds.py`, late updates `test_protocol_late.py`, margins
`test_protocol_margins.py`, rejections and discarded rounds `test_protocol_rejections.py`)."""

import dataclasses

import pytest
import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.inprocess import JoinRefusedError
from ddiloco.learner import Learner
from ddiloco.messages import FragmentState, Send
from ddiloco.syncer import Syncer, replay_rounds
from tests.helpers import (
    FP32,
    TinyNet,
    adamw,
    make_batches,
    make_system,
    params_of,
    publish,
    single_fragment,
    train_step,
)


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


def test_replaying_the_round_log_reproduces_the_global_state_bit_for_bit():
    config = DilocoConfig(num_fragments=3, sync_every=6, overlap_steps=1, codec="int4")
    syncer, hub, clock, learners = make_system(3, config, QuorumConfig(min_quorum=2, grace="fixed", grace_s=0.05),
                                               optimizer=adamw)
    initial = params_of(TinyNet(seed=100))
    for step in range(30):
        for i, learner in enumerate(learners):
            if learner.can_step:
                publish(hub, learner, clock, step + 0.1 * i)
            else:
                learner.stop_waiting()
    assert syncer.rounds_committed >= 10
    replayed = replay_rounds(config, initial, hub.round_log)
    for name, tensor in syncer.global_params().items():
        assert torch.equal(replayed[name], tensor), name


def test_join_refusals_name_the_mismatch():
    config = single_fragment()
    syncer, hub, _, _ = make_system(1, config)
    before = syncer.global_params()
    wide = TinyNet(width=4)
    with pytest.raises(JoinRefusedError, match="model differs.*token_embedding.weight"):
        hub.join(Learner(config, learner_id=5, model=wide))
    other = single_fragment(outer_lr=0.5)
    with pytest.raises(JoinRefusedError, match="algorithm config differs"):
        hub.join(Learner(other, learner_id=6, model=TinyNet()))
    assert all(torch.equal(before[n], t) for n, t in syncer.global_params().items())
    assert syncer.alive_learners() == [0]


def test_a_learner_never_trains_before_joining_and_its_init_never_becomes_global():
    config = single_fragment()
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
    config = single_fragment(sync_every=4, overlap_steps=2)
    syncer, hub, clock, (learner, _) = make_system(2, config, QuorumConfig(min_quorum=2, grace="none"))
    for t in range(4):
        publish(hub, learner, clock, float(t))     # publishes at inner step 4
    assert learner.can_step
    publish(hub, learner, clock, 4.0)
    assert learner.can_step                         # inner step 5 < 4 + 2
    publish(hub, learner, clock, 5.0)
    assert not learner.can_step and learner.blocking_fragments() == [0]
    assert learner.stop_waiting() == [0] and learner.can_step
    assert learner.stats.waits_abandoned == 1


def test_applying_a_fragment_keeps_optimizer_state_and_resets_counters():
    config = DilocoConfig(num_fragments=2, sync_every=2, overlap_steps=4, **FP32)
    syncer, hub, clock, (learner,) = make_system(1, config, QuorumConfig(grace="none"), optimizer=adamw)
    publish(hub, learner, clock, 0.0)                        # round 0 (fragment 0) due at step 1
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
            publish(hub, learner, clock, float(step))
            if syncer.rounds_committed > committed:
                p = hub.round_log[-1].fragment
                global_ = syncer.global_params()
                for other in learners:
                    assert other.versions[p] == syncer.versions[p]
                    params = dict(other.model.named_parameters())
                    for name in syncer.plan.fragments[p]:
                        assert torch.equal(params[name].detach(), global_[name])


def test_syncer_state_dict_round_trip():
    config = DilocoConfig(num_fragments=2, sync_every=2, overlap_steps=4, **FP32)
    syncer, hub, clock, (learner,) = make_system(1, config, QuorumConfig(grace="none", heartbeat_timeout_s=1000.0))
    for t in range(6):
        publish(hub, learner, clock, float(t))
    restored = Syncer(config, QuorumConfig(grace="none"), initial_params=params_of(TinyNet(seed=3)))
    restored.load_state_dict(syncer.state_dict())
    assert restored.versions == syncer.versions and restored.rounds_committed == syncer.rounds_committed
    assert all(torch.equal(restored.global_params()[n], t) for n, t in syncer.global_params().items())
    assert restored.alive_learners() == []  # learners must join a restored syncer again


def test_a_rejoin_keeps_work_on_current_fragments_and_publishes_a_lost_update_again():
    """A syncer restarted with the round open lost the learner's update: the Welcome brings the very
    version the learner published from, so the learner keeps its local work on that fragment and
    publishes it again at once (with K = M the others' round waits for exactly that update)."""
    config = single_fragment(sync_every=4, overlap_steps=2)
    syncer, hub, clock, (learner, _) = make_system(2, config, QuorumConfig(min_quorum=2, grace="none"))
    for t in range(4):
        publish(hub, learner, clock, float(t))       # publishes fragment 0 from version 0 at inner step 4
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


def test_a_learner_that_leaves_after_its_last_work_and_rejoins_at_once_does_not_hold_the_round_up():
    """Its last work (a final update) waits in the round; it comes back before the round closes, sends that work again
    (refused: the round holds it) and waits for the round. With K = M the round then needed an update from it that
    could not come: every learner waited out max_wait_s (60 s) at each quick close-and-reopen of a session."""
    config = single_fragment(sync_every=4, overlap_steps=0)
    syncer, hub, clock, (first, second) = make_system(2, config, QuorumConfig(min_quorum=2, grace="none"))
    batches = make_batches(4, seed=5)
    for batch in batches[:2]:
        second.after_inner_step(train_step(second.model, second.optimizer, batch))
    for update in second.flush():  # the session closes: its last work, then its Leave
        assert update.final
        hub.send(update)
    hub.leave(second)
    hub.join(second)  # a new session of the same learner, at once: its update of the round is sent again
    assert syncer.rounds_committed == 0
    for t, batch in enumerate(batches):
        clock.advance_to(float(t))
        hub.after_inner_step(first, train_step(first.model, first.optimizer, batch))
    assert syncer.rounds_committed == 1
    assert {p.learner_id for p in hub.round_log[0].participants} == {0, 1}


def test_a_fragment_whose_only_round_is_the_last_work_takes_all_of_it():
    """H at or above the learners' budget: no round closes before the end, and the final flush carries the whole run.
    It was scaled as a partial period (40 / 1000 of an outer step): the global model kept 4 % of the training (the
    built-in model's validation loss 4.85 where H = 16 reached 2.54). Like a fragment's other first rounds, it is not
    scaled."""
    config = single_fragment(sync_every=1000, overlap_steps=0, outer_lr=1.0, outer_momentum=0.0)
    syncer, hub, clock, (learner,) = make_system(1, config, QuorumConfig(grace="none", heartbeat_timeout_s=1000.0))
    for t, batch in enumerate(make_batches(40, seed=3)):
        clock.advance_to(float(t))
        hub.after_inner_step(learner, train_step(learner.model, learner.optimizer, batch))
    assert syncer.rounds_committed == 0
    trained = {name: value.clone() for name, value in params_of(learner.model).items()}
    for update in learner.flush():
        assert update.final
        hub.send(update)
    hub.leave(learner)
    assert syncer.rounds_committed == 1
    # Outer lr 1 without momentum and one participant: the global model is the learner's.
    for name, value in trained.items():
        torch.testing.assert_close(syncer.global_params()[name], value, rtol=1e-5, atol=1e-6)
