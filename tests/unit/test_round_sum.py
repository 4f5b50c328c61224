"""The streaming merge (issue 16): a round summed as its updates arrive equals the batch merge of the same updates in
the same order, bit for bit, and the documented arithmetic written out here; with capped weights, rejected, late,
replaced and folded updates; with values the wire layer decoded once into reused buffers; and replay stays exact."""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.compression import CODEC_NAMES, get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.merge import cap_weights, merge_round, token_weight
from ddiloco.messages import Commit, Join, RejectReason, Update
from ddiloco.round_log import round_record_from_json
from ddiloco.syncer import Syncer, replay_rounds
from ddiloco.update_values import DecodeBuffers, check_values, decode_payload, l2_norm

SHAPES = {"emb": (6, 4), "w": (5, 7), "b": (9,)}
EMBEDDINGS = ("emb",)
GRACE_S = 10.0


def _config(codec: str = "fp32") -> DilocoConfig:
    return DilocoConfig(num_fragments=1, fragment_strategy="single", codec=codec)


def _initial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _syncer(codec: str = "fp32", *, learners: int = 4, min_quorum: int = 2) -> Syncer:
    # A fixed grace: every update sent before advance(GRACE_S) lands in the round, whatever its order.
    config = _config(codec)
    syncer = Syncer(config, QuorumConfig(min_quorum=min_quorum, grace="fixed", grace_s=GRACE_S),
                    initial_params=_initial(), embeddings=EMBEDDINGS)
    for learner_id in range(learners):
        syncer.receive(Join(learner_id, syncer.spec, config.fingerprint()), 0.0)
    return syncer


def _deltas(seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: scale * torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _update(syncer: Syncer, learner_id: int, deltas, *, steps: int = 4, tokens: int = 400,
            base: int | None = None) -> Update:
    codec = get_codec(syncer.config.codec)
    base = syncer.versions[0] if base is None else base
    payload = {name: codec.encode(deltas[name]) for name in syncer.plan.fragments[0]}
    return Update(learner_id, 0, base, steps * (base + 1), steps, tokens, syncer.config.codec, payload)


def _close(syncer: Syncer, now: float):
    (commit,) = [a for a in syncer.advance(now) if isinstance(a, Commit)]
    return commit.record


def _decoded(syncer: Syncer, deltas) -> dict[str, torch.Tensor]:
    """What the syncer holds of `deltas` once they crossed the wire (the codec's rounding)."""
    codec = get_codec(syncer.config.codec)
    return {name: codec.decode(codec.encode(t), t.shape) for name, t in deltas.items()}


def stated_norm(values: torch.Tensor) -> float:
    """||values|| as docs/protocol.md states it, for fewer values than one chunk: 16 float64 lanes of exact squares
    (value i to lane i % 16), each summed in order, then the lanes in order."""
    lanes = [0.0] * 16
    for i, v in enumerate(values.reshape(-1).tolist()):
        lanes[i % 16] += v * v
    total = 0.0
    for lane in lanes:
        total += lane
    return math.sqrt(total)


def reference(entries: list[tuple[dict[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """The arithmetic docs/protocol.md states, written out: coefficients relative to the first positive weight,
    float32 sums in arrival order (the product, then the sum, each rounded), float64 scalars."""
    first = next(w for _, w in entries if w > 0)
    merged = {}
    for name in SHAPES:
        total = norms = 0.0
        acc = None
        for values, weight in entries:
            c = weight / first
            total += c
            if name in EMBEDDINGS:
                alpha = c
            else:
                norms += c * stated_norm(values[name])
                alpha = c / stated_norm(values[name])
            if c > 0:
                acc = values[name] * alpha if acc is None else acc + values[name] * alpha
        merged[name] = acc / total if name in EMBEDDINGS else acc * ((norms / total) / stated_norm(acc))
    return merged


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def _batch(entries) -> dict[str, torch.Tensor]:
    return merge_round([d for d, _ in entries], [w for _, w in entries], method="rda", embeddings=EMBEDDINGS)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_round_summed_as_it_arrives_equals_the_batch_merge_and_the_stated_arithmetic(codec):
    syncer = _syncer(codec)
    sent = {i: _deltas(seed=i) for i in (2, 0, 1)}
    counts = {2: (3, 300), 0: (4, 400), 1: (5, 640)}  # weights 30000, 40000, 81920: no cap binds (k = 16)
    for now, learner_id in enumerate((2, 0, 1)):  # not in learner order: the sums follow arrival
        steps, tokens = counts[learner_id]
        syncer.receive(_update(syncer, learner_id, sent[learner_id], steps=steps, tokens=tokens), float(now))
    record = _close(syncer, GRACE_S + 3)
    assert record.summed == (2, 0, 1) and [p.learner_id for p in record.participants] == [0, 1, 2]
    entries = [(_decoded(syncer, sent[i]), token_weight(counts[i][1], counts[i][0])) for i in (2, 0, 1)]
    assert bits_equal(record.merged, _batch(entries))
    assert bits_equal(record.merged, reference(entries))
    assert not bits_equal(record.merged, _batch([entries[1], entries[2], entries[0]]))  # the order is part of it


def test_a_capped_weight_sums_the_round_again_with_the_capped_weights():
    syncer = _syncer()
    honest, heavy = _deltas(seed=0), _deltas(seed=1)
    syncer.receive(_update(syncer, 1, heavy, steps=1, tokens=2**20), 0.0)  # weight 2^40: far over 16x the other
    syncer.receive(_update(syncer, 0, honest, steps=8, tokens=1024), 1.0)
    record = _close(syncer, GRACE_S + 1)
    raw = [token_weight(2**20, 1), token_weight(1024, 8)]
    capped = cap_weights(raw, QuorumConfig().max_weight_ratio)
    assert capped[0] < raw[0] and [p.weight for p in record.participants] == [capped[1], capped[0]]
    entries = [(heavy, capped[0]), (honest, capped[1])]
    assert bits_equal(record.merged, _batch(entries)) and bits_equal(record.merged, reference(entries))
    assert not bits_equal(record.merged, _batch([(heavy, raw[0]), (honest, raw[1])]))


def test_rejected_updates_add_nothing_and_a_late_one_is_summed_where_it_arrived():
    syncer = _syncer()
    first = {i: _deltas(seed=10 + i) for i in (0, 1)}
    for learner_id in (0, 1):
        syncer.receive(_update(syncer, learner_id, first[learner_id]), 0.0)
    _close(syncer, GRACE_S)  # version 1
    late, second = _deltas(seed=20), {i: _deltas(seed=30 + i) for i in (0, 1)}
    syncer.receive(_update(syncer, 2, late, base=0), GRACE_S + 1)  # staleness 1: rides in the next round
    nan = _update(syncer, 3, _deltas(seed=40))
    nan_payload = dict(nan.payload, w=torch.full(SHAPES["w"], math.nan).numpy().tobytes())
    syncer.receive(Update(**{**nan.__dict__, "payload": nan_payload}), GRACE_S + 2)
    syncer.receive(_update(syncer, 0, _deltas(seed=50), base=0), GRACE_S + 2)  # overlaps its merged work: stale
    for learner_id in (0, 1):
        syncer.receive(_update(syncer, learner_id, second[learner_id]), GRACE_S + 3)
    record = _close(syncer, 2 * GRACE_S + 3)
    assert record.summed == (2, 0, 1)
    assert {r.reason for r in syncer.rejections} == {RejectReason.NON_FINITE, RejectReason.STALE}
    weight = token_weight(400, 4)
    entries = [(late, weight), (second[0], weight), (second[1], weight)]
    assert bits_equal(record.merged, _batch(entries)) and bits_equal(record.merged, reference(entries))
    assert [p.staleness for p in record.participants] == [0, 0, 1]


def test_a_replaced_update_keeps_its_place_and_a_folded_one_sums_its_parts():
    syncer = _syncer()
    syncer.receive(_update(syncer, 0, _deltas(seed=0), steps=4, tokens=400), 0.0)
    syncer.receive(_update(syncer, 1, _deltas(seed=1)), 0.5)  # the quorum: the round closes at 10.5
    longer = _deltas(seed=2)
    syncer.receive(_update(syncer, 0, longer, steps=6, tokens=600), 1.0)  # the same base, more steps: replaces
    syncer.receive(_update(syncer, 2, _deltas(seed=3)), 1.5)
    record = _close(syncer, 11.0)
    assert record.summed == (0, 1, 2)
    entries = [(longer, token_weight(600, 6)), (_deltas(seed=1), token_weight(400, 4)),
               (_deltas(seed=3), token_weight(400, 4))]
    assert bits_equal(record.merged, _batch(entries))

    for learner_id in (0, 1):  # version 2 from learners 0 and 1 only: learner 2 misses it
        syncer.receive(_update(syncer, learner_id, _deltas(seed=5 + learner_id)), 12.0)
    _close(syncer, 23.0)
    late, newer = _deltas(seed=10), _deltas(seed=11)
    syncer.receive(_update(syncer, 2, late, base=1), 24.0)  # late: held in the round of version 3
    syncer.receive(_update(syncer, 2, newer, base=2), 25.0)  # its next work: folded with the held one
    for learner_id in (0, 1):
        syncer.receive(_update(syncer, learner_id, _deltas(seed=12 + learner_id)), 25.0)
    record = _close(syncer, 36.0)
    (folded,) = [p for p in record.participants if p.learner_id == 2]
    assert folded.folded == ((1, 4 * 2),) and folded.steps == 8 and folded.tokens == 800
    summed = {name: late[name] + newer[name] for name in SHAPES}
    entries = [(summed, token_weight(800, 8)), (_deltas(seed=12), token_weight(400, 4)),
               (_deltas(seed=13), token_weight(400, 4))]
    assert record.summed == (2, 0, 1) and bits_equal(record.merged, _batch(entries))


def test_values_decoded_by_the_wire_layer_are_used_once_and_not_kept():
    syncer = _syncer("int4")
    codec, buffers = get_codec("int4"), DecodeBuffers()
    sent = {i: _deltas(seed=i) for i in (0, 1)}
    held = []
    for learner_id in (0, 1):
        update = _update(syncer, learner_id, sent[learner_id])
        into = [buffers.take(codec.buffer_numel(math.prod(SHAPES[n]))) for n in syncer.plan.fragments[0]]
        decoded = decode_payload(codec, update.payload, syncer.plan.fragments[0], SHAPES, into=into)
        # The core takes the wire layer's values (here: those of another payload, to tell them apart).
        other = _update(syncer, learner_id, _deltas(seed=7 + learner_id))
        syncer.receive(Update(**{**other.__dict__, "decoded": decoded}), float(learner_id))
        for buffer in into:
            buffer.fill_(math.nan)  # reused at once by the next update: the core kept nothing of it
        buffers.give(into)
        held.append(into)
    record = _close(syncer, GRACE_S + 1)
    weight = token_weight(400, 4)
    assert bits_equal(record.merged, _batch([(_decoded(syncer, sent[i]), weight) for i in (0, 1)]))
    assert buffers.allocated == len(SHAPES)  # the second update reused the first one's buffers


def test_the_round_log_keeps_the_summation_order_and_replay_stays_exact():
    syncer = _syncer()
    records = []
    for round_index in range(3):
        order = (1, 0) if round_index % 2 else (0, 1)
        for learner_id in order:
            syncer.receive(_update(syncer, learner_id, _deltas(seed=10 * round_index + learner_id)),
                           GRACE_S * round_index)
        records.append(_close(syncer, GRACE_S * (round_index + 1)))
    assert [r.summed for r in records] == [(0, 1), (1, 0), (0, 1)]
    again = [round_record_from_json(r.to_json(), dict(r.merged)) for r in records]
    assert [r.summed for r in again] == [r.summed for r in records]
    replayed = replay_rounds(_config(), _initial(), again)
    assert bits_equal(replayed, syncer.global_params())


def test_l2_norm_is_finite_exactly_when_every_value_is_and_exact_at_the_float32_extremes():
    for scale in (1e20, 1e-25, 1.0):  # squares past float32's range, and into its subnormals: exact in float64
        values = scale * torch.randn(1000, generator=torch.Generator().manual_seed(0))
        assert l2_norm(values) == stated_norm(values) > 0
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for bad in (math.nan, math.inf, -math.inf):
        values[17] = bad
        assert not math.isfinite(l2_norm(values))
        assert check_values("w", values) == (RejectReason.NON_FINITE, "w holds non-finite values (NaN or Inf)")


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("numel", [1000, 1001])
def test_decoding_into_a_reused_buffer_gives_the_same_bits(codec_name, numel):
    codec = get_codec(codec_name)
    buffer = torch.full((codec.buffer_numel(numel) + 5,), math.nan)
    for seed in (0, 1):
        data = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))
        into = codec.decode(data, (numel,), out=buffer)
        assert into.data_ptr() == buffer.data_ptr()
        assert torch.equal(into.view(torch.int32), codec.decode(data, (numel,)).view(torch.int32))
    with pytest.raises(TypeError, match="at least"):
        codec.decode(data, (numel,), out=torch.empty(numel - 1))


def test_an_update_whose_norm_is_subnormal_counts_as_a_norm_of_zero_and_the_merge_stays_finite():
    # A parameter trained only by weight decay from 1e-37 sends changes near 1e-40: its direction's factor, 1 / norm,
    # was infinite in float32, so every round of its fragment was non-finite and never committed.
    normal, tiny, zero = (torch.full((5,), value) for value in (0.1, 1e-40, 0.0))
    merged = merge_round([{"w": normal}, {"w": tiny}], [1.0, 1.0])["w"]
    assert torch.isfinite(merged).all()
    assert torch.equal(merged, merge_round([{"w": normal}, {"w": zero}], [1.0, 1.0])["w"])
    assert torch.equal(merge_round([{"w": tiny}], [1.0])["w"], torch.zeros(5))
