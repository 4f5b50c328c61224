"""The learner's rules between messages (`LearnerRules`): wait bound, rejoin position, final flush, faults."""

from __future__ import annotations

import torch

from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.inprocess import InProcessHub
from ddiloco.learner import Learner
from ddiloco.learner_rules import Action, LearnerRules
from ddiloco.messages import FragmentState, Refused, Update, Welcome
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, make_batches, params_of, sgd, train_step

CONFIG = DilocoConfig(num_fragments=2, sync_every=4, overlap_steps=1, codec="fp32")


class Recorder:
    """WorkEvents that keeps what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def publish(self, update):
        self.events.append(("publish", update.fragment, update.inner_step))

    def fate(self, update, fate, reason):
        self.events.append(("fate", update.fragment, fate))

    def welcome(self, welcome, *, inner_step, replaced):
        self.events.append(("welcome", inner_step, tuple(replaced)))

    def received(self, state, *, inner_step):
        self.events.append(("received", state.fragment, state.version))

    def position(self, *, inner_step, next_round):
        self.events.append(("position", inner_step, next_round))

    def end(self, state, *, inner_step):
        self.events.append(("end", state, inner_step))


def welcome_at(versions: list[int], learner_id: int = 0) -> Welcome:
    model = TinyNet(seed=9)
    learner = Learner(CONFIG, learner_id=learner_id, model=model)
    tensors = dict(model.named_parameters())
    states = tuple(FragmentState(p, v, {n: tensors[n].detach().clone() for n in learner.plan.fragments[p]})
                   for p, v in enumerate(versions))
    return Welcome(learner_id, states, CONFIG.fingerprint())


def rules_for(*, synchronous=False, max_wait_s=5.0, events=None) -> LearnerRules:
    model = TinyNet(seed=1)
    learner = Learner(CONFIG, learner_id=0, model=model, optimizer=sgd(model))
    return LearnerRules(learner, LearnerConfig(max_wait_s=max_wait_s), synchronous=synchronous, events=events)


def test_nothing_trains_before_the_welcome_and_a_refusal_stops():
    rules = rules_for()
    assert rules.next(0.0).action is Action.JOIN
    rules.receive(Refused(0, "model differs"), 0.0)
    assert rules.next(0.0).action is Action.REFUSED and rules.refusal == "model differs"


def test_a_blocked_learner_waits_until_the_bound_then_trains_on():
    events = Recorder()
    rules = rules_for(max_wait_s=5.0, events=events)
    rules.receive(welcome_at([0, 0]), 0.0)
    assert rules.next(0.0).action is Action.STEP
    updates = []
    for _ in range(3):  # round 0 (fragment 0) falls due at inner step 2; tau = 1 blocks at step 3
        updates += rules.after_inner_step(tokens=10)
    assert [u.fragment for u in updates] == [0] and ("publish", 0, 2) in events.events
    waiting = rules.next(10.0)
    assert waiting.action is Action.WAIT and waiting.until == 15.0
    assert rules.next(14.9) == waiting  # the bound counts from when the wait began
    assert rules.next(15.0).action is Action.STEP
    assert rules.learner.stats.waits_abandoned == 1 and rules.last_wait_s == 5.0


def test_a_fresh_incarnation_takes_the_global_position_a_resumed_one_keeps_its_own():
    # Versions (3, 2) with P = 2: rounds 0..5 committed once each; round 6 is next, due at inner step 14.
    fresh = rules_for(events=(events := Recorder()))
    fresh.receive(welcome_at([3, 3]), 0.0)
    assert (fresh.learner.inner_step, fresh.learner.schedule.next_round) == (13, 6)
    assert ("position", 13, 6) in events.events
    resumed = rules_for()
    resumed.resumed = True
    resumed.learner.inner_step, resumed.learner.schedule.next_round = 5, 2
    resumed.receive(welcome_at([3, 3]), 0.0)
    assert (resumed.learner.inner_step, resumed.learner.schedule.next_round) == (5, 2)  # K < M: its checkpoint's
    synchronous = rules_for(synchronous=True)
    synchronous.resumed = True
    synchronous.learner.inner_step, synchronous.learner.schedule.next_round = 5, 2
    synchronous.receive(welcome_at([3, 3]), 0.0)
    assert (synchronous.learner.inner_step, synchronous.learner.schedule.next_round) == (13, 6)  # K = M: in phase
    synchronous.receive(welcome_at([3, 3]), 1.0)  # a re-join in phase: nothing moves
    assert (synchronous.learner.inner_step, synchronous.learner.schedule.next_round) == (13, 6)
    resumed.receive(welcome_at([4, 4]), 1.0)  # K < M: a re-join keeps its own position, behind or not
    assert (resumed.learner.inner_step, resumed.learner.schedule.next_round) == (5, 2)


def test_a_synchronous_learner_that_re_joins_behind_the_run_takes_its_position_one_ahead_keeps_its_own():
    # A learner paused past the heartbeat timeout (SIGSTOP, a partition) joined again with the position it had:
    # rounds 6 and 7 were committed without it, it published round 6 next, and in a run where every round waits
    # for every live learner each round waited its max_wait_s (60 s) for an update of another phase.
    rules = rules_for(synchronous=True, events=(events := Recorder()))
    rules.receive(welcome_at([3, 3]), 0.0)
    assert (rules.learner.inner_step, rules.learner.schedule.next_round) == (13, 6)
    rules.receive(welcome_at([4, 4]), 1.0)  # rounds 6 and 7 committed meanwhile: round 8 next, due at step 18
    assert (rules.learner.inner_step, rules.learner.schedule.next_round) == (17, 8)
    assert events.events.count(("position", 17, 8)) == 1
    ahead = rules_for(synchronous=True)
    ahead.receive(welcome_at([3, 3]), 0.0)
    ahead.learner.schedule.next_round = 7  # it published round 6, which a syncer restart lost
    ahead.receive(welcome_at([3, 3]), 1.0)
    assert (ahead.learner.inner_step, ahead.learner.schedule.next_round) == (13, 7)


def test_a_syncer_that_went_back_is_a_refusal_and_its_older_state_is_not_applied():
    # A syncer restarted from a backup of its run directory (or a copy of the run at the same address): the live
    # learners joined again, took its older state and trained on in silence, the rounds since lost.
    rules = rules_for(synchronous=True)
    rules.receive(welcome_at([3, 3]), 0.0)
    held = {name: value.detach().clone() for name, value in rules.learner.model.named_parameters()}
    rules.receive(welcome_at([3, 3]), 1.0)  # the same versions again (a partition): trains on
    assert rules.refusal is None and rules.next(1.0).action is Action.STEP
    assert rules.receive(welcome_at([3, 2]), 2.0) == []
    assert rules.next(2.0).action is Action.REFUSED
    assert "version 2 of fragment 1" in rules.refusal and "had received version 3" in rules.refusal
    assert rules.learner.versions == [3, 3]
    assert all(torch.equal(value, held[name]) for name, value in rules.learner.model.named_parameters())


def test_a_malformed_message_is_ignored_not_a_crash():
    rules = rules_for()
    rules.receive(welcome_at([0, 0]), 0.0)
    assert rules.receive(FragmentState(7, 1, {}), 0.0) == []  # no fragment 7
    assert rules.next(0.0).action is Action.STEP


def test_the_final_flush_publishes_every_fragment_with_unpublished_work_and_it_is_merged():
    syncer = Syncer(CONFIG, QuorumConfig(grace="none"), initial_params=params_of(TinyNet(seed=100)))
    hub = InProcessHub(syncer, clock=VirtualClock())
    model = TinyNet(seed=1)
    learner = Learner(CONFIG, learner_id=0, model=model, optimizer=sgd(model))
    hub.join(learner)
    rules = LearnerRules(learner, LearnerConfig(), synchronous=False)
    for batch in make_batches(5, seed=0):  # rounds at steps 2 (fragment 0) and 4 (fragment 1)
        for update in rules.after_inner_step(train_step(model, learner.optimizer, batch)):
            hub.send(update)
    assert learner.unpublished() == [3, 1]
    final = rules.finish()
    assert sorted(u.fragment for u in final) == [0, 1] and all(isinstance(u, Update) for u in final)
    before = syncer.rounds_committed
    for update in final:
        hub.send(update)
    assert syncer.rounds_committed == before + 2
    local = dict(model.named_parameters())
    # K = 1, one learner, outer lr 0.7 with momentum: the merged rounds moved the global model toward it.
    assert all(not torch.equal(syncer.global_params()[n], params_of(TinyNet(seed=100))[n]) for n in local)
    assert rules.finish() == []  # nothing left to publish
