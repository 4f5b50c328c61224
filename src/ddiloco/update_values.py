"""An update's payload decoded once and checked: float32 values, all finite, with their L2 norms.

The wire layer decodes each update as it arrives (`UpdateAssembler.finish`, on the gRPC server's threads,
outside the syncer's lock) and hands the result to the syncer core in `Update.decoded`; a driver that
passes updates without it (the in-process hub, the simulator) lets the core call `decode_payload` itself.
Either way a payload is decoded and checked once, by the same function, so both give the same bits.

The check and the norm are one pass: the L2 norm (`ddiloco.kernels.l2_norm`, a float64 sum of the values' exact
squares in a fixed order) is finite exactly when every value is (NaN and Inf propagate into it), so no separate
`isfinite` pass is needed. The norm is a deterministic function of the values, so the streaming merge and its batch
reference (`ddiloco.round_sum`) agree bit for bit.

An int4 payload is not decoded at all where the compiled kernels are built: its norm is taken straight from its codes
(the same values, so the same bits as decoding first), and the update's values stay `Int4Blocks`, a view of the
payload, which the round's sums decode as they add them (`ddiloco.kernels.accumulate`): a float32 copy of the update
is never written.

Decoding into reused buffers (`DecodeBuffers`): the values of an update live only until the syncer core has
added them to its round's sums, and a fresh tensor the size of a large fragment costs more in page faults
(about 5x an `add_` pass over it, measured on this machine) than decoding into memory already mapped.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence

import torch

from ddiloco import kernels
from ddiloco.codec_interface import Codec
from ddiloco.compression import Int4Codec
from ddiloco.kernel_threads import INLINE, KernelThreads
from ddiloco.kernels import Int4Blocks
from ddiloco.messages import DecodedTensor, RejectReason


def l2_norm(values: torch.Tensor | Int4Blocks, threads: KernelThreads = INLINE) -> float:
    """||values||_2 as a Python float: inf or NaN when a value is not finite (see the module docstring)."""
    return kernels.l2_norm(values, threads)


def check_values(name: str, values: torch.Tensor | Int4Blocks,
                 threads: KernelThreads = INLINE) -> DecodedTensor | tuple[RejectReason, str]:
    """`values` with its norm, or (NON_FINITE, why) when a value is NaN or Inf."""
    norm = l2_norm(values, threads)
    if not math.isfinite(norm):
        return _not_finite(name)
    return DecodedTensor(values, norm)


def _not_finite(name: str) -> tuple[RejectReason, str]:
    return RejectReason.NON_FINITE, f"{name} holds non-finite values (NaN or Inf)"


MAX_FREE_BUFFERS = 64
"""Buffers `DecodeBuffers` keeps for reuse; more given back are dropped (freed)."""


class DecodeBuffers:
    """float32 buffers to decode updates into, reused: `take` one per tensor, `give` them back once their values
    are no longer needed (the core has added them to its sums). Thread-safe: the gRPC server's threads decode at
    once, so it holds about one update's worth per thread decoding at the same time, however many updates pass."""

    def __init__(self, max_free: int = MAX_FREE_BUFFERS) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.max_free = max_free
        self.allocated = 0
        """Buffers made so far (the rest of the takes reused one)."""

    def take(self, numel: int) -> torch.Tensor:
        """A contiguous float32 tensor of at least `numel` values (the smallest free one that fits, or a new one)."""
        with self._lock:
            fits = [i for i, t in enumerate(self._free) if t.numel() >= numel]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            self.allocated += 1
        return torch.empty(numel, dtype=torch.float32)

    def give(self, buffers: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._free.extend(buffers)
            del self._free[:max(0, len(self._free) - self.max_free)]


def decode_payload(codec: Codec, payload: Mapping[str, bytes], names: Sequence[str],
                   shapes: Mapping[str, tuple[int, ...]], *, into: Sequence[torch.Tensor] = (),
                   threads: KernelThreads = INLINE) -> dict[str, DecodedTensor] | tuple[RejectReason, str]:
    """The tensors `names` of `payload`, decoded and checked in that order; or (reason, detail) for the first
    that is malformed (wrong byte count) or not finite. `into`: one buffer per name to decode into (see
    `DecodeBuffers`; each of at least `codec.buffer_numel` values); none: new tensors. An int4 payload is read in
    place when the compiled kernels are built (`Int4Blocks`; `into` is then not written)."""
    in_place = reads_in_place(codec)
    values, malformed = [], None
    for i, name in enumerate(names):
        try:
            if in_place:
                values.append(_int4_blocks(codec, payload[name], shapes[name]))
            else:
                values.append(codec.decode(payload[name], shapes[name], out=into[i] if into else None))
        except ValueError as exc:
            malformed = RejectReason.MALFORMED, f"{name}: {exc}"
            break
    decoded = {}
    # The norms of all tensors decoded, handed to the threads at once; the first problem in `names` order is reported.
    for name, tensor, norm in zip(names, values, kernels.l2_norms(values, threads), strict=False):
        if not math.isfinite(norm):
            return _not_finite(name)
        decoded[name] = DecodedTensor(tensor, norm)
    return malformed if malformed is not None else decoded


def reads_in_place(codec: Codec) -> bool:
    """Whether `decode_payload` reads this codec's payloads where they lie (no buffers needed: `Int4Blocks`)."""
    return kernels.compiled is not None and isinstance(codec, Int4Codec)


def _int4_blocks(codec: Int4Codec, data: bytes, shape: tuple[int, ...]) -> Int4Blocks:
    numel = math.prod(shape)
    expected = codec.encoded_nbytes(numel)
    if len(data) != expected:  # the message `decode` gives
        raise ValueError(f"{codec.name} payload for {numel} values must be {expected} bytes, got {len(data)}")
    return Int4Blocks(bytes(data), numel, codec.block_size)


def float_values(values: torch.Tensor | Int4Blocks) -> torch.Tensor:
    """The values as a float32 tensor (`Int4Blocks` decoded, flat)."""
    return values.decode() if isinstance(values, Int4Blocks) else values
