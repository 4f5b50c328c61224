"""The cap on an update's norm (`QuorumConfig.max_norm_ratio`): one learner whose parameters were corrupted (a flipped
bit in memory: a value of 1e30) moves the global model no further than an ordinary round. Before, its huge update
went into the merge at its full norm and the global model took it: every learner then received the corruption."""

from __future__ import annotations

import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Commit, Join, Update
from ddiloco.round_sum import RoundSum
from ddiloco.syncer import Syncer, replay_rounds
from ddiloco.update_values import l2_norm

SHAPES = {"emb": (6, 4), "w": (5, 7), "b": (9,)}
CONFIG = DilocoConfig(num_fragments=1, fragment_strategy="single", codec="fp32")


def initial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def run_rounds(quorum: QuorumConfig, *, corrupt_in_round: int, commits: list | None = None) -> tuple[Syncer, list]:
    """4 learners, 4 rounds of small updates; in one round learner 2's `w` holds one value of 1e30. `commits`: the
    round's Commit actions are appended to it."""
    syncer = Syncer(CONFIG, quorum, initial_params=initial(), embeddings=("emb",))
    for learner_id in range(4):
        syncer.receive(Join(learner_id, syncer.spec, CONFIG.fingerprint()), 0.0)
    codec, generator, records = get_codec("fp32"), torch.Generator().manual_seed(7), []
    for round_index in range(4):
        for learner_id in range(4):
            deltas = {name: 1e-2 * torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
            if round_index == corrupt_in_round and learner_id == 2:
                deltas["w"][1, 3] = 1e30
                deltas["emb"][0, 0] = -1e30
            payload = {name: codec.encode(deltas[name]) for name in syncer.plan.fragments[0]}
            base = syncer.versions[0]
            actions = syncer.receive(Update(learner_id, 0, base, 4 * (base + 1), 4, 400, "fp32", payload),
                                     float(round_index))
        records += [a.record for a in actions if isinstance(a, Commit)]
        if commits is not None:
            commits += [a for a in actions if isinstance(a, Commit)]
    assert len(records) == 4
    return syncer, records


def test_a_corrupted_update_moves_the_global_model_no_further_than_an_ordinary_round():
    quorum = QuorumConfig(min_quorum=4, grace="none")
    syncer, records = run_rounds(quorum, corrupt_in_round=2, commits=(commits := []))
    assert [c.capped for c in commits] == [(), (), (2,), ()]  # the service counts them per learner (SyncerTally)
    merged_norms = [{n: l2_norm(t) for n, t in r.merged.items()} for r in records]
    for name in SHAPES:  # the corrupted round's merge: at most what a round with one update at the cap (10 x) gives
        assert merged_norms[2][name] < 10 * max(merged_norms[1][name], merged_norms[3][name])
    assert max(float(t.abs().max()) for t in syncer.global_params().values()) < 10
    assert syncer.capped_updates == 1  # learner 2's update of round 2
    assert torch.equal(replay_rounds(CONFIG, initial(), records)["w"], syncer.global_params()["w"])

    uncapped, _ = run_rounds(QuorumConfig(min_quorum=4, grace="none", max_norm_ratio=0), corrupt_in_round=2)
    assert float(uncapped.global_params()["w"].abs().max()) > 1e28  # what the run took before the cap


def test_no_cap_in_a_fragments_first_two_rounds():
    # Its first round is too short to measure a norm by: the cap starts from the second round's.
    for round_index in (0, 1):
        syncer, _ = run_rounds(QuorumConfig(min_quorum=4, grace="none"), corrupt_in_round=round_index)
        assert syncer.capped_updates == 0 and float(syncer.global_params()["w"].abs().max()) > 1e28


def test_a_fragment_nobody_trained_for_a_round_is_not_capped_to_nothing():
    # A parameter first used later (an auxiliary head, a layer unfrozen at step 20): its rounds of zero updates left a
    # reference of 0, every later update was capped to 0, and the message's ratio divided by 0 inside the close,
    # after the round was durable: the syncer's timer died and the run stalled (found by running such a script).
    syncer = Syncer(CONFIG, QuorumConfig(min_quorum=2, grace="none"), initial_params=initial())
    for learner_id in range(2):
        syncer.receive(Join(learner_id, syncer.spec, CONFIG.fingerprint()), 0.0)
    codec = get_codec("fp32")
    for round_index in range(5):
        for learner_id in range(2):
            scale = 0.0 if round_index < 3 else 1e-2
            payload = {name: codec.encode(scale * torch.ones(shape)) for name, shape in SHAPES.items()}
            base = syncer.versions[0]
            syncer.receive(Update(learner_id, 0, base, 4 * (base + 1), 4, 400, "fp32", payload), float(round_index))
    assert syncer.versions[0] == 5 and syncer.capped_updates == 0
    assert not torch.equal(syncer.global_params()["w"], initial()["w"])


def test_a_round_of_zero_updates_does_not_take_the_cap_off_the_next():
    # A learner with its own token pushed an all-zero update that closed a round alone (K = 1): the reference became
    # 0, which caps nothing, and its next update, of values 1e20, went into the global model (3.9e20 where the largest
    # parameter had been 3.45), and every learner's model was NaN from then on.
    syncer = Syncer(CONFIG, QuorumConfig(min_quorum=1, grace="none"), initial_params=initial())
    syncer.receive(Join(0, syncer.spec, CONFIG.fingerprint()), 0.0)
    codec, generator = get_codec("fp32"), torch.Generator().manual_seed(3)

    def push(values: dict[str, torch.Tensor], at: float) -> None:
        base = syncer.versions[0]
        payload = {name: codec.encode(values[name]) for name in syncer.plan.fragments[0]}
        syncer.receive(Update(0, 0, base, 4 * (base + 1), 4, 400, "fp32", payload), at)

    for round_index in range(3):  # a reference from the second round on
        push({name: 1e-2 * torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}, round_index)
    push({name: torch.zeros(shape) for name, shape in SHAPES.items()}, 3.0)
    push({name: torch.full(shape, 1e20) for name, shape in SHAPES.items()}, 4.0)
    assert syncer.versions[0] == 5 and syncer.capped_updates == 1
    assert max(float(t.abs().max()) for t in syncer.global_params().values()) < 10


def test_the_cap_scales_a_whole_update_and_a_capped_update_does_not_raise_the_reference():
    from ddiloco.messages import DecodedTensor

    def decoded(values):
        return {n: DecodedTensor(v, l2_norm(v)) for n, v in values.items()}

    names = ("r", "m")
    small = {"r": torch.tensor([3.0, 0.0]), "m": torch.tensor([0.0, 4.0])}  # norm 5
    huge = {"r": torch.tensor([300.0, 0.0]), "m": torch.tensor([0.0, 400.0])}  # norm 500
    summed = RoundSum(names, embeddings=("m",), cap=50.0)
    summed.add(0, decoded(small), 1.0)
    summed.add(1, decoded(huge), 1.0)
    assert summed.capped == [(1, 500.0)]
    assert summed.reference_norm() == 5.0  # learner 1 left out: it was capped
    merged = summed.result({"r": (2,), "m": (2,)})
    assert torch.allclose(merged["r"], torch.tensor([16.5, 0.0]))  # RDA: norms (3 + 300 / 10) / 2, one direction
    assert torch.allclose(merged["m"], torch.tensor([0.0, 22.0]))  # mean: (4 + 400 / 10) / 2

    every_one = RoundSum(names, embeddings=("m",), cap=50.0)
    every_one.add(0, decoded(huge), 1.0)
    assert every_one.reference_norm() == 50.0  # every update capped: the reference is the cap
