"""A new run's genesis on the wire: a learner's initial parameters, proposed with PushGenesis.

Same framing as every message with tensors (`ddiloco.transport.grpc_codec`): a header naming each
tensor (float32, in model order), the embedding names and tied aliases, and the CRC32 of the bytes;
then the raw bytes in chunks. Everything is checked before it becomes a `Genesis`: the header before
any data is read, the bytes against the CRC, the values for finiteness.

The size a header declares is only its sender's claim: it must fit what the syncer could hold
(`genesis_limit_bytes`), and the buffer grows with the bytes that actually arrive, so a header alone costs
nothing. Whether the syncer wants a genesis at all, and from whom, is the server's to check
(`ddiloco.transport.syncer_servicer`), between `check_header` and the first data.
"""

from __future__ import annotations

import math
import os
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
"""The bound on a genesis's declared float32 bytes where the machine's memory cannot be read (a trillion-byte model)."""
SYNCER_BYTES_PER_GENESIS_BYTE = 3
"""The syncer holds about 12 bytes per parameter at rest (global values, outer momentum, downlink residual;
docs/runtime.md, "The syncer's memory and threads") for the genesis's 4."""


def genesis_limit_bytes() -> int:
    """The largest genesis (declared float32 bytes) a syncer on this machine could run: a third of its physical
    memory. A header declaring more is refused before any data is read."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf, or these names unknown to it
        return MAX_GENESIS_BYTES
    return min(MAX_GENESIS_BYTES, memory // SYNCER_BYTES_PER_GENESIS_BYTE)


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

    def __init__(self, *, max_bytes: int = MAX_GENESIS_BYTES) -> None:
        """`max_bytes`: the most float32 bytes a header may declare (`genesis_limit_bytes`)."""
        self.max_bytes = max_bytes
        self.header: wire_pb2.GenesisHeader | None = None
        self._receiver: _Receiver | None = None

    def check_header(self, chunk: wire_pb2.GenesisChunk) -> wire_pb2.GenesisHeader:
        """Check the first chunk's header, taking none of its data and allocating nothing: the server checks who
        sent it, and whether the run wants a genesis, before `add_data` takes the first chunk's data."""
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
        if total > self.max_bytes:
            raise WireError("oversize", f"a genesis of {total} bytes exceeds the {self.max_bytes} this syncer could "
                            "hold", grpc.StatusCode.RESOURCE_EXHAUSTED)
        unknown = sorted(set(h.embeddings) - set(names))
        if unknown:
            raise WireError("malformed", f"embedding {unknown[0]!r} is not one of the genesis tensors")
        decode_aliases(h.aliases, set(names))
        self.header = h
        self._receiver = _Receiver(total, grow=True)
        return h

    def add(self, chunk: wire_pb2.GenesisChunk) -> None:
        if chunk.HasField("header"):
            raise WireError("malformed", "a second header inside one genesis stream")
        self.add_data(chunk.data)

    def add_data(self, data: bytes) -> None:
        assert self._receiver is not None, "check_header() first"
        self._receiver.add(data)

    def release(self) -> None:
        """Let go of the bytes received (a `Genesis` from `finish` keeps its tensors')."""
        self._receiver = None

    def finish(self) -> Genesis:
        assert self.header is not None and self._receiver is not None, "check_header() first"
        self._receiver.require_complete()
        h, buffer = self.header, self._receiver.buffer
        check_crc32(buffer, h.crc32, f"genesis of learner {h.learner_id}")
        tensors, _ = _float32_tensors(h.tensors, buffer, 0)
        for name, tensor in tensors.items():
            if not bool(torch.isfinite(tensor).all()):
                raise WireError(str(RejectReason.NON_FINITE), f"tensor {name!r} holds NaN or Inf values")
        return Genesis(int(h.learner_id), tensors, tuple(sorted(set(h.embeddings))),
                       decode_aliases(h.aliases, set(tensors)))
