"""The syncer with its compiled kernels (an int4 update read from its codes, the fused close) and without them (the
eager torch path: decode, then the outer optimizer, then the downlink rule) commits the same rounds, rejects the same,
sends the same bytes and holds the same bits; replay of either's round log gives them too. (A finite step whose
change is not, which the fused close leaves to the eager path, is `tests/unit/test_kernels.py`'s.)"""

from __future__ import annotations

import pytest
import torch

from ddiloco import kernels
from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Commit, FragmentDelta, Join, Rejected, Send, Update
from ddiloco.syncer import Syncer, replay_rounds

pytestmark = pytest.mark.skipif(kernels.compiled is None, reason="ddiloco._kernels is not built")

SHAPES = {"emb": (70, 9), "w": (33, 31), "b": (257,)}  # blocks of 256 (int8) and 64 (int4) with tails
LEARNERS = 3


SPIKE_LR = 1e6
"""With this outer learning rate (and the default outer momentum 0.5: u = 1.5 g), a merged value of 2.6e32 would move
a parameter of 2e38 by 3.9e38, past float32's range: the round must not commit, with or without the kernels."""


def _config(outer_lr: float = 0.7) -> DilocoConfig:
    return DilocoConfig(num_fragments=1, fragment_strategy="single", codec="int4", downlink_codec="int8",
                        outer_lr=outer_lr)


def _initial(*, spike: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    initial = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    if spike:
        initial["b"][5] = 2e38
    return initial


def _run(rounds: int, *, spike_round: int | None = None):
    """The broadcasts and records of `rounds` rounds of 3 learners, and the syncer."""
    config = _config(SPIKE_LR if spike_round is not None else 0.7)
    # No norm cap: the spike must reach the outer step, whose overflow is what the spike's round tests.
    syncer = Syncer(config, QuorumConfig(min_quorum=LEARNERS, grace="none", max_norm_ratio=0),
                    initial_params=_initial(spike=spike_round is not None),
                    embeddings=("emb",))
    for learner_id in range(LEARNERS):
        syncer.receive(Join(learner_id, syncer.spec, config.fingerprint()), 0.0)
    codec = get_codec("int4")
    generator = torch.Generator().manual_seed(4)
    broadcasts, records = [], []
    for round_index in range(rounds):
        for learner_id in range(LEARNERS):
            deltas = {name: 1e-2 * torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
            deltas["w"][:2] = 0.0  # a zero block in the change of every round
            if round_index == spike_round:
                deltas["b"][5] = 2.6e32  # see SPIKE_LR
            payload = {name: codec.encode(deltas[name]) for name in syncer.plan.fragments[0]}
            base = syncer.versions[0]
            actions = syncer.receive(Update(learner_id, 0, base, 4 * (base + 1), 4, 400 + learner_id, "int4",
                                            payload), float(round_index))
        records += [a.record for a in actions if isinstance(a, Commit)]
        broadcasts.append(next(a.message for a in actions if isinstance(a, Send)))
    return broadcasts, records, syncer


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


@pytest.mark.parametrize("spike_round", [None, 2])
def test_the_compiled_and_the_eager_syncer_hold_the_same_bits(monkeypatch, spike_round):
    fused = _run(5, spike_round=spike_round)
    assert fused[2].model.fused_close is not None
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "compiled", None)
        eager = _run(5, spike_round=spike_round)
        assert eager[2].model.fused_close is None
    for r_fused, r_eager in zip(fused[1], eager[1], strict=True):
        assert _same_tensors(r_fused.merged, r_eager.merged)
    for b_fused, b_eager in zip(fused[0], eager[0], strict=True):
        assert type(b_fused) is type(b_eager)
        if isinstance(b_fused, FragmentDelta):
            assert b_fused.payload == b_eager.payload and b_fused.checksum == b_eager.checksum
        else:
            assert b_fused == b_eager  # the spike's round: rejected as non_finite by both
    if spike_round is not None:
        assert isinstance(fused[0][spike_round], Rejected) and len(fused[1]) == 4
        assert fused[2].rejection_counts == eager[2].rejection_counts == {"non_finite": LEARNERS}
    assert _same_tensors(fused[2].global_params(), eager[2].global_params())
    momentum = [s["momentum_buffer"] for s in fused[2].outer.state_dict()[0]["state"].values()]
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in
               zip(momentum, eager[2].outer.state_dict()[0]["state"].values(), strict=True))
    config = _config(SPIKE_LR if spike_round is not None else 0.7)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "compiled", None)
        replayed_eagerly = replay_rounds(config, _initial(spike=spike_round is not None), fused[1])
    initial = _initial(spike=spike_round is not None)
    assert _same_tensors(replay_rounds(config, initial, eager[1]), fused[2].global_params())
    assert _same_tensors(replayed_eagerly, fused[2].global_params())


def test_after_a_fused_step_the_next_check_is_a_bound_and_a_spike_still_takes_the_exact_check(monkeypatch):
    checks = []
    kernel = kernels.nesterov_int8

    def counting(batch, **options):
        checks.extend(tensor.first_step for tensor in batch if tensor.out is None)
        return kernel(batch, **options)

    monkeypatch.setattr(kernels, "nesterov_int8", counting)
    _run(3)
    assert len(checks) == len(SHAPES)  # the first round's check only: the later ones were bounded
    checks.clear()
    _, records, syncer = _run(3, spike_round=2)
    # "b", whose parameter of 2e38 is beyond the bound's reach, is checked by the kernel in rounds 2 and 3 (where it
    # finds the spike); the others stay bounded.
    assert checks == [True] * len(SHAPES) + [False, False]
    assert syncer.rejection_counts == {"non_finite": LEARNERS}
