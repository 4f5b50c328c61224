"""A new run's genesis on the wire: a learner's initial parameters, proposed with PushGenesis.

Same framing as every message with tensors (`ddiloco.transport.grpc_codec`): a header naming each
tensor (float32, in model order), the embedding names and tied aliases, and the CRC32 of the bytes;
then the raw bytes in chunks. Everything is checked before it becomes a `Genesis`: the header before
any data is read, the bytes against the CRC, the values for finiteness.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc
import torch

from ddiloco.messages import RejectReason
from ddiloco.transport import wire_pb2
from ddiloco.transport.grpc_codec import (
    CHUNK_BYTES,
    MAX_LEARNER_ID,
    WIRE_DTYPE,
    WireError,
    _float32_tensors,
    _Receiver,
    _with_first_data,
    check_crc32,
    crc32_of,
    decode_aliases,
    iter_data,
    tensor_bytes,
)

MAX_GENESIS_BYTES = 1 << 40
"""A genesis declaring more float32 bytes than this (a trillion-byte model) is refused before any is read."""


@dataclass(frozen=True)
class Genesis:
    """A new run's initial global parameters, as a learner proposes them (float32, CPU)."""

    learner_id: int
    tensors: Mapping[str, torch.Tensor]
    embeddings: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...] = ()


def encode_genesis(genesis: Genesis, chunk_bytes: int = CHUNK_BYTES) -> Iterator[wire_pb2.GenesisChunk]:
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in genesis.tensors.items()}
    header = wire_pb2.GenesisChunk(header=wire_pb2.GenesisHeader(
        learner_id=genesis.learner_id, embeddings=list(genesis.embeddings),
        aliases=[f"{alias}={name}" for alias, name in genesis.aliases],
        tensors=[wire_pb2.TensorHeader(name=n, dtype=WIRE_DTYPE, shape=list(t.shape), nbytes=t.numel() * 4)
                 for n, t in tensors.items()],
        crc32=crc32_of(tensor_bytes(t) for t in tensors.values())))
    yield from _with_first_data(header, iter_data(tensor_bytes(t) for t in tensors.values()), wire_pb2.GenesisChunk)


class GenesisAssembler:
    """Reassembles one PushGenesis stream, validating the header before any data is read."""

    def __init__(self) -> None:
        self.header: wire_pb2.GenesisHeader | None = None
        self._receiver: _Receiver | None = None

    def start(self, chunk: wire_pb2.GenesisChunk) -> None:
        if not chunk.HasField("header"):
            raise WireError("malformed", "the first chunk of a genesis must hold its header")
        h = chunk.header
        if not 0 <= h.learner_id <= MAX_LEARNER_ID:
            raise WireError(str(RejectReason.UNKNOWN_LEARNER), f"learner_id={h.learner_id} is invalid")
        names = [t.name for t in h.tensors]
        if not names or len(set(names)) != len(names) or not all(names):
            raise WireError("malformed", "a genesis needs at least one tensor and unique, non-empty names")
        total = 0
        for t in h.tensors:
            if t.dtype != WIRE_DTYPE or any(d < 0 for d in t.shape):
                raise WireError("malformed", f"tensor {t.name!r}: expected float32 with a shape of sizes >= 0")
            if t.nbytes != 4 * math.prod(t.shape):
                raise WireError("malformed", f"tensor {t.name!r} declares {t.nbytes} bytes, expected "
                                f"{4 * math.prod(t.shape)}")
            total += t.nbytes
        if total > MAX_GENESIS_BYTES:
            raise WireError("oversize", f"a genesis of {total} bytes exceeds {MAX_GENESIS_BYTES}",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)
        unknown = sorted(set(h.embeddings) - set(names))
        if unknown:
            raise WireError("malformed", f"embedding {unknown[0]!r} is not one of the genesis tensors")
        decode_aliases(h.aliases, set(names))
        self.header = h
        self._receiver = _Receiver(total)
        if chunk.data:
            self._receiver.add(chunk.data)

    def add(self, chunk: wire_pb2.GenesisChunk) -> None:
        if chunk.HasField("header"):
            raise WireError("malformed", "a second header inside one genesis stream")
        assert self._receiver is not None, "start() first"
        self._receiver.add(chunk.data)

    def finish(self) -> Genesis:
        assert self.header is not None and self._receiver is not None, "start() first"
        self._receiver.require_complete()
        h, buffer = self.header, self._receiver.buffer
        check_crc32(buffer, h.crc32, f"genesis of learner {h.learner_id}")
        tensors, _ = _float32_tensors(h.tensors, buffer, 0)
        for name, tensor in tensors.items():
            if not bool(torch.isfinite(tensor).all()):
                raise WireError(str(RejectReason.NON_FINITE), f"tensor {name!r} holds NaN or Inf values")
        return Genesis(int(h.learner_id), tensors, tuple(sorted(set(h.embeddings))),
                       decode_aliases(h.aliases, set(tensors)))
