"""Tensors whose bytes encode zeros (a frozen parameter's pseudo-gradient or change) travel as their headers alone,
and come back bit for bit (`ddiloco.zero_encodings`, `TensorHeader.zero`)."""

from __future__ import annotations

import pytest
import torch

from ddiloco.compression import CODEC_NAMES, get_codec
from ddiloco.config import DilocoConfig
from ddiloco.downlink import DeltaDownlink
from ddiloco.fragments import FragmentPlan
from ddiloco.messages import FragmentDelta, ModelSpec, Update
from ddiloco.transport.grpc_codec import UpdateAssembler, WireError, WireModel, encode_update
from ddiloco.transport.syncer_stream import SyncerStreamDecoder, encode_syncer_message
from ddiloco.zero_encodings import SAMPLES, encodes_zeros, zero_bytes

SIZES = [1, 2, 3, 5, 63, 64, 65, 255, 256, 257, 1000, 4097, 300_001]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_the_layout_of_zeros_is_what_encode_writes_and_is_recognised(name):
    codec = get_codec(name)
    for numel in SIZES:
        encoded = codec.encode(torch.zeros(numel))
        assert zero_bytes(codec, numel) == encoded
        assert encodes_zeros(codec, numel, encoded) and encodes_zeros(codec, numel, memoryview(bytearray(encoded)))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_one_value_that_is_not_zero_anywhere_is_told_apart(name):
    codec = get_codec(name)
    numel = 300_001
    for index in (0, 1, 777, numel // 2 + 3, numel - 1):  # most of them between the sampled bytes
        values = torch.zeros(numel)
        values[index] = 1e-3
        assert not encodes_zeros(codec, numel, codec.encode(values)), index
    assert not encodes_zeros(codec, numel - 1, codec.encode(torch.zeros(numel)))  # a length that does not fit
    empty = codec.encode(torch.zeros(0))  # fp8's scale alone: four bytes
    assert encodes_zeros(codec, 0, empty) == (len(empty) > 0)


def test_a_negative_zero_is_not_a_zero_encoding():
    codec = get_codec("fp32")
    assert not encodes_zeros(codec, 10, codec.encode(torch.full((10,), -0.0)))


def test_a_payload_that_passes_the_samples_is_still_read_whole():
    codec = get_codec("int4")
    numel = 200_000
    data = bytearray(codec.encode(torch.zeros(numel)))
    head, fill = codec.zero_layout(numel)
    step = (len(data) - 1) / (SAMPLES - 1)
    position = int(step * 10) + 5  # between two sampled bytes, in the codes
    assert position > head
    data[position] ^= 0x01
    assert not encodes_zeros(codec, numel, bytes(data))


@pytest.fixture
def model():
    params = {"frozen.weight": torch.randn(300, 40), "frozen.bias": torch.randn(300),
              "head.weight": torch.randn(2, 300)}
    config = DilocoConfig(num_fragments=1, codec="int4")
    return params, WireModel(ModelSpec.from_named_tensors(params.items()), FragmentPlan.for_tensors(params, config),
                             "int4")


def test_an_update_sends_no_bytes_of_its_zero_tensors_and_decodes_bit_for_bit(model):
    params, wire = model
    codec = get_codec("int4")
    payload = {name: codec.encode(torch.zeros_like(t) if name.startswith("frozen") else 0.01 * t)
               for name, t in params.items()}
    update = Update(1, 0, 2, 10, 4, 96, "int4", payload)
    chunks = list(encode_update(update, wire.spec, chunk_bytes=64))
    header = chunks[0].header
    assert [t.zero for t in header.tensors] == [True, True, False]
    assert sum(len(c.data) for c in chunks) == len(payload["head.weight"])
    assembler = UpdateAssembler(wire)
    assembler.start(chunks[0])
    for chunk in chunks[1:]:
        assembler.add(chunk)
    back = assembler.finish()
    assert back == update and back.zero == {"frozen.weight", "frozen.bias"}
    assert back.payload_bytes == len(payload["head.weight"]) < update.payload_bytes
    assert [back.decoded[n].norm for n in params][:2] == [0.0, 0.0] and back.decoded["head.weight"].norm > 0


def test_a_header_that_calls_a_tensor_zero_that_was_not_is_refused_as_corrupt(model):
    params, wire = model
    codec = get_codec("int4")
    update = Update(1, 0, 2, 10, 4, 96, "int4", {name: codec.encode(0.01 * t) for name, t in params.items()})
    chunks = list(encode_update(update, wire.spec, chunk_bytes=64))
    head_bytes = len(update.payload["head.weight"])
    chunks[0].header.tensors[2].zero = True  # a sender that claims it, with the bytes still in the stream
    assembler = UpdateAssembler(wire)
    with pytest.raises(WireError) as caught:
        assembler.start(chunks[0])
        for chunk in chunks[1:]:
            assembler.add(chunk)
        assembler.finish()
    assert caught.value.reason in ("oversize", "corrupt") and head_bytes > 0


def test_a_frozen_parameters_change_travels_as_its_header_and_rebuilds_the_same_global_value(model):
    params, wire = model
    wire = WireModel(wire.spec, wire.plan, "int4", "int8")
    downlink = DeltaDownlink("int8", wire.plan, {n: tuple(t.shape) for n, t in params.items()})
    tensors = {n: t.clone() for n, t in params.items()}
    previous = downlink.before_step(0, tensors)
    tensors["head.weight"].mul_(1.01)  # the frozen ones do not move
    delta = downlink.after_step(0, 5, previous, tensors)
    assert isinstance(delta, FragmentDelta) and delta.zero == {"frozen.weight", "frozen.bias"}
    assert delta.payload_bytes == len(delta.payload["head.weight"])
    chunks = list(encode_syncer_message(delta, chunk_bytes=64))
    assert sum(len(c.data) for c in chunks) == delta.payload_bytes
    back = [m for m in map(SyncerStreamDecoder(wire).feed, chunks) if m is not None]
    assert back == [delta] and back[0].zero == delta.zero
    assert all(bytes(back[0].payload[n]) == bytes(delta.payload[n]) for n in params)
