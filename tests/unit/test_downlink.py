"""The compressed downlink (`ddiloco.downlink`): syncer and learners rebuild identical bits, error
feedback loses nothing, a learner that cannot rebuild joins again, and replay stays bit-exact."""

import dataclasses

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.downlink import DeltaDownlink, fragment_checksum
from ddiloco.fragments import FragmentPlan
from ddiloco.learner import Learner
from ddiloco.messages import Commit, FragmentDelta, FragmentState, Join, Send, Update, Welcome
from ddiloco.syncer import Syncer, replay_rounds
from tests.helpers import TinyNet, adamw, make_batches, make_system, params_of, train_step

CONFIG = DilocoConfig(num_fragments=2, sync_every=4, overlap_steps=1, codec="int4", downlink_codec="int8")
QUORUM = QuorumConfig(min_quorum=2, grace="none")


def _train(hub, clock, learners, steps, *, start=0):
    for step in range(start, start + steps):
        clock.advance_to(float(step))
        hub.advance()
        for learner in learners:
            if not learner.can_step:
                learner.stop_waiting()
            batch = make_batches(1, seed=1000 * learner.learner_id + step)[0]
            hub.after_inner_step(learner, train_step(learner.model, learner.optimizer, batch))


def _assert_hold_the_global(syncer, learner):
    global_ = syncer.global_params()
    params = dict(learner.model.named_parameters())
    for p, names in enumerate(syncer.plan.fragments):
        assert learner.versions[p] == syncer.versions[p]
        for name in names:
            assert torch.equal(learner.local.base[p][name], global_[name]), name
    # Parameters equal the global only where nothing was trained since the fragment arrived.
    for p, names in enumerate(syncer.plan.fragments):
        if learner.steps_since[p] == 0:
            for name in names:
                assert torch.equal(params[name].detach(), global_[name]), name


# ---- the rule on its own -------------------------------------------------------------------------


def _plan_and_tensors(values):
    tensors = {"w": torch.tensor(values, dtype=torch.float32)}
    config = DilocoConfig(num_fragments=1, fragment_strategy="single")
    return FragmentPlan.for_tensors(tensors, config), tensors


def test_the_change_is_rebuilt_as_previous_plus_decoded_and_the_residual_keeps_the_rest():
    plan, tensors = _plan_and_tensors([0.0] * 8)
    downlink = DeltaDownlink("int8", plan, {"w": (8,)})
    previous = downlink.before_step(0, tensors)
    target = torch.tensor([1.0, 0.003, -0.5, 0.25, 0.0, 0.01, -0.002, 0.7])
    tensors["w"].copy_(target)  # the outer step's result
    delta = downlink.after_step(0, 1, previous, tensors)
    assert isinstance(delta, FragmentDelta) and (delta.version, delta.base_version) == (1, 0)
    decoded = get_codec("int8").decode(delta.payload["w"], (8,))
    assert torch.equal(tensors["w"], previous["w"] + decoded)      # the syncer's global is what learners rebuild
    assert torch.equal(downlink.state_dict()["w"], target - decoded)  # residual = change - decoded
    assert delta.checksum == fragment_checksum(tensors, ["w"])
    assert not torch.equal(tensors["w"], target)  # int8 lost something this round


def test_error_feedback_delivers_changes_smaller_than_a_quantisation_step():
    # A value that moves by +-1 every round sets the block's scale (1 / 127): an increment of 0.001 per
    # round is under half a step, so without the residual it would round to 0 every time; with it, the
    # value follows its exact trajectory within half a step, and global + residual is that trajectory.
    plan, tensors = _plan_and_tensors([0.0, 0.0])
    downlink = DeltaDownlink("int8", plan, {"w": (2,)})
    exact = torch.zeros(2)
    for version in range(1, 41):
        previous = downlink.before_step(0, tensors)
        step = torch.tensor([(-1.0) ** version, 0.001])
        exact += step
        tensors["w"].add_(step)  # the outer step's result
        downlink.after_step(0, version, previous, tensors)
        torch.testing.assert_close(tensors["w"] + downlink.state_dict()["w"], exact, atol=1e-6, rtol=0)
        assert abs(float(tensors["w"][1] - exact[1])) <= 0.5 / 127 + 1e-6
    assert float(tensors["w"][1]) > 0.035  # 40 x 0.001 arrived (less at most half a step)


def test_a_change_that_is_not_finite_goes_out_exact_and_resets_the_residual():
    plan, tensors = _plan_and_tensors([-3e38, 1.0])
    downlink = DeltaDownlink("int8", plan, {"w": (2,)})
    previous = downlink.before_step(0, tensors)
    tensors["w"].copy_(torch.tensor([3e38, 2.0]))  # 3e38 - (-3e38) overflows float32
    message = downlink.after_step(0, 1, previous, tensors)
    assert isinstance(message, FragmentState) and torch.equal(message.tensors["w"], tensors["w"])
    assert torch.equal(downlink.state_dict()["w"], torch.zeros(2))


# ---- syncer and learners -------------------------------------------------------------------------


@pytest.mark.parametrize("downlink_codec", ["int8", "int4"])
def test_syncer_and_learners_hold_identical_bits_after_many_rounds(downlink_codec):
    config = dataclasses.replace(CONFIG, downlink_codec=downlink_codec)
    syncer, hub, clock, learners = make_system(2, config, QUORUM, optimizer=adamw)
    sent = []
    hub_run = hub._run

    def spy(actions):
        sent.extend(a.message for a in actions if isinstance(a, Send))
        hub_run(actions)

    hub._run = spy
    _train(hub, clock, learners, 24)
    assert syncer.rounds_committed >= 10
    assert any(isinstance(m, FragmentDelta) for m in sent)
    assert not any(isinstance(m, FragmentState) for m in sent)  # every round went out compressed
    for learner in learners:
        assert learner.stats.downlink_resyncs == 0
        _assert_hold_the_global(syncer, learner)


def test_each_round_sends_its_fragment_in_the_downlink_codec():
    sizes = {name: p.numel() for name, p in TinyNet().named_parameters()}
    per_value = {"fp32": lambda n: 4 * n, "int8": lambda n: n + 4}  # every TinyNet tensor is one int8 block
    sent = {}
    for codec, nbytes in per_value.items():
        config = dataclasses.replace(CONFIG, downlink_codec=codec)
        syncer, hub, clock, learners = make_system(2, config, QUORUM)
        joined = syncer.bytes_sent
        _train(hub, clock, learners, 8)
        expected = sum(2 * sum(nbytes(sizes[n]) for n in syncer.plan.fragments[r.fragment]) for r in hub.round_log)
        assert syncer.bytes_sent - joined == expected
        assert all(learner.stats.bytes_received - joined // 2 == expected // 2 for learner in learners)
        sent[codec] = expected
    assert sent["int8"] < 0.27 * sent["fp32"]


def test_fp32_downlink_broadcasts_the_exact_outer_step():
    config = dataclasses.replace(CONFIG, codec="fp32", downlink_codec="fp32")
    syncer, hub, clock, learners = make_system(2, config, QUORUM)
    initial = params_of(TinyNet(seed=100))
    _train(hub, clock, learners, 12)
    exact = Syncer(config, QuorumConfig(), initial_params=initial)
    for record in hub.round_log:
        exact.outer.step(record.fragment, record.merged)  # the outer step alone, no downlink rule
    assert all(torch.equal(exact.global_params()[n], t) for n, t in syncer.global_params().items())
    for learner in learners:
        _assert_hold_the_global(syncer, learner)


class _Net:
    """Sans-I/O by hand: carries each message to its side at once; `tamper(learner_id, message)` may drop
    (return None) or change a syncer -> learner message on its way."""

    def __init__(self, syncer, learners, tamper=lambda learner_id, message: message):
        self.syncer, self.learners, self.tamper, self.now = syncer, learners, tamper, 0.0

    def up(self, message):
        for action in self.syncer.receive(message, self.now):
            if isinstance(action, Send):
                self.down(action.learner_id, action.message)

    def down(self, learner_id, message):
        message = self.tamper(learner_id, message)
        if message is not None:
            for reply in self.learners[learner_id].receive(message):
                self.up(reply)

    def train(self, steps):
        for _ in range(steps):
            self.now += 1.0
            for learner in self.learners:
                if not learner.can_step:
                    learner.stop_waiting()
                batch = make_batches(1, seed=1000 * learner.learner_id + learner.inner_step)[0]
                for update in learner.after_inner_step(train_step(learner.model, learner.optimizer, batch)):
                    self.up(update)


def _sans_io_system(num_learners, config, tamper=lambda learner_id, message: message, quorum=QUORUM):
    syncer = Syncer(config, quorum, initial_params=params_of(TinyNet(seed=100)))
    learners = [Learner(config, learner_id=i, model=(model := TinyNet(seed=i)), optimizer=adamw(model))
                for i in range(num_learners)]
    net = _Net(syncer, learners, tamper)
    for learner in learners:
        net.up(learner.join_message())
    return syncer, learners, net


def test_a_learner_that_missed_a_version_joins_again_and_ends_identical():
    dropped = []

    def drop(learner_id, message):
        if learner_id == 1 and isinstance(message, FragmentDelta) and not dropped:
            dropped.append(message.version)
            return None
        return message

    # K = 1: each learner's update makes a round of its own, so learner 1 gets the next round's change
    # (from the version it missed) before it publishes again.
    config = dataclasses.replace(CONFIG, num_fragments=1, fragment_strategy="single")
    syncer, learners, net = _sans_io_system(2, config, drop, quorum=QuorumConfig(min_quorum=1, grace="none"))
    net.train(24)
    assert dropped and syncer.rounds_committed >= 4
    assert learners[1].stats.downlink_resyncs == 1 and learners[0].stats.downlink_resyncs == 0
    assert learners[1].stats.joins == 2 and learners[1].joined
    for learner in learners:
        _assert_hold_the_global(syncer, learner)


def test_a_checksum_that_disagrees_makes_the_learner_join_again_without_applying_anything():
    syncer, learners, net = _sans_io_system(2, CONFIG)
    net.train(8)
    learner = learners[0]
    before = {name: t.detach().clone() for name, t in learner.model.named_parameters()}
    version = learner.versions[0]
    # A genuine change of fragment 0 from the version the learner holds, made by the rule itself.
    names = syncer.plan.fragments[0]
    downlink = DeltaDownlink("int8", syncer.plan, {n: tuple(t.shape) for n, t in before.items()})
    tensors = {n: learner.local.base[0][n].clone() for n in names}
    previous = downlink.before_step(0, tensors)
    for tensor in tensors.values():
        tensor.add_(0.01)
    good = downlink.after_step(0, version + 1, previous, tensors)
    first = names[0]
    zeroed = bytes(len(good.payload[first]))  # decodes (scales 0) to a different value: the checksum catches it
    for bad in (dataclasses.replace(good, checksum=good.checksum ^ 1),
                dataclasses.replace(good, payload={**good.payload, first: zeroed}),
                dataclasses.replace(good, payload={**good.payload, first: good.payload[first][:-1]})):
        learner.joined = True
        assert [type(r) for r in learner.receive(bad)] == [Join] and not learner.joined
        assert learner.versions[0] == version
        assert all(torch.equal(before[n], t.detach()) for n, t in learner.model.named_parameters())
    assert learner.stats.downlink_resyncs == 3
    learner.joined = True
    # Applied; the learner first publishes its unpublished work on fragment 0 (Learner._publish_before).
    replies = learner.receive(good)
    assert [(type(r), r.fragment, r.base_version) for r in replies] == [(Update, 0, version)]
    assert learner.versions[0] == version + 1
    assert all(torch.equal(learner.local.base[0][n], tensors[n]) for n in names)


def test_a_corrupted_change_in_flight_is_recovered_by_a_rejoin():
    corrupted = []

    def corrupt(learner_id, message):
        if learner_id == 0 and isinstance(message, FragmentDelta) and not corrupted:
            corrupted.append(message.version)
            return dataclasses.replace(message, checksum=message.checksum ^ 0xFF)
        return message

    syncer, learners, net = _sans_io_system(2, CONFIG, corrupt)
    net.train(20)
    assert corrupted and learners[0].stats.downlink_resyncs == 1
    for learner in learners:
        _assert_hold_the_global(syncer, learner)


def test_an_older_change_is_ignored_as_stale():
    old = []

    def keep(learner_id, message):
        if isinstance(message, FragmentDelta) and learner_id == 0:
            old.append(message)
        return message

    syncer, learners, net = _sans_io_system(2, CONFIG, keep)
    net.train(12)
    learner = learners[0]
    stale_before = learner.stats.fragments_ignored_stale
    assert learner.receive(old[0]) == []
    assert learner.stats.fragments_ignored_stale == stale_before + 1 and learner.stats.downlink_resyncs == 0
    _assert_hold_the_global(syncer, learner)


# ---- replay and restart --------------------------------------------------------------------------


def test_replay_and_restart_are_bit_exact_with_the_int8_downlink():
    syncer, hub, clock, learners = make_system(3, CONFIG, QuorumConfig(min_quorum=2, grace="fixed", grace_s=0.05),
                                               optimizer=adamw)
    initial = params_of(TinyNet(seed=100))
    _train(hub, clock, learners, 12)
    middle = syncer.state_dict()
    done = syncer.rounds_committed
    _train(hub, clock, learners, 12, start=12)
    assert syncer.rounds_committed >= done + 4
    final = syncer.global_params()
    replayed = replay_rounds(CONFIG, initial, hub.round_log)
    assert all(torch.equal(replayed[n], t) for n, t in final.items())
    # Replaying without the downlink rule would not give these bits (the rule changes the global state).
    exact = Syncer(dataclasses.replace(CONFIG, downlink_codec="fp32"), QuorumConfig(), initial_params=initial)
    exact.apply_committed(hub.round_log)
    assert not all(torch.equal(exact.global_params()[n], t) for n, t in final.items())
    # A restart from the middle state plus the rest of the log: the residuals came along.
    restored = Syncer(CONFIG, QuorumConfig(), initial_params=initial)
    restored.load_state_dict(middle)
    restored.apply_committed(hub.round_log[done:])
    assert all(torch.equal(restored.global_params()[n], t) for n, t in final.items())
    residual = restored.model.downlink.state_dict()
    assert all(torch.equal(residual[n], t) for n, t in syncer.model.downlink.state_dict().items())


def test_a_restored_syncer_without_residuals_is_refused():
    syncer = Syncer(CONFIG, QuorumConfig(), initial_params=params_of(TinyNet(seed=100)))
    state = syncer.state_dict()
    state["downlink_residual"] = {}
    with pytest.raises(ValueError, match="residuals"):
        Syncer(CONFIG, QuorumConfig(), initial_params=params_of(TinyNet(seed=100))).load_state_dict(state)


def test_welcome_and_stale_catch_up_stay_float32():
    syncer, learners, net = _sans_io_system(2, CONFIG, quorum=QuorumConfig(min_quorum=2, grace="none",
                                                                           max_staleness=1))
    net.train(8)
    actions = syncer.receive(learners[0].join_message(), net.now)
    (welcome,) = [a.message for a in actions if isinstance(a, Send)]
    assert isinstance(welcome, Welcome) and all(isinstance(s, FragmentState) for s in welcome.fragments)
    # An update too stale to merge: the learner is sent the current fragment, whole.
    stale = Update(1, 0, 0, learners[1].inner_step + 1, 1, 8, "int4", {
        n: get_codec("int4").encode(torch.zeros(t.shape)) for n, t in syncer.global_params().items()
        if n in syncer.plan.fragments[0]})
    assert syncer.versions[0] > syncer.quorum.max_staleness
    sends = [a.message for a in syncer.receive(stale, net.now) if isinstance(a, Send)]
    assert any(isinstance(m, FragmentState) and m.fragment == 0 for m in sends)
    assert not any(isinstance(a, Commit) for a in actions)
