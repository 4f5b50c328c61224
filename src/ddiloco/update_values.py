"""An update's payload decoded once and checked: float32 values, all finite, with their L2 norms.

The wire layer decodes each update as it arrives (`UpdateAssembler.finish`, on the gRPC server's threads,
outside the syncer's lock) and hands the result to the syncer core in `Update.decoded`; a driver that
passes updates without it (the in-process hub, the simulator) lets the core call `decode_payload` itself.
Either way a payload is decoded and checked once, by the same function, so both give the same bits.

The check and the norm are one pass: the L2 norm of float32 values is finite exactly when every value is
(NaN and Inf propagate into it), so no separate `isfinite` pass (which is ten times slower than an `add_`
over the same values) is needed. The norm is first taken with float32 accumulation (fast); when that is
not a finite number of normal size (values near 1e19 square past float32's range, values near 1e-19 square
into its subnormals) it is taken again in float64, which decides. The norm is a deterministic function of
the values, so the streaming merge and its batch reference (`ddiloco.round_sum`) agree bit for bit.

Decoding into reused buffers (`DecodeBuffers`): the values of an update live only until the syncer core has
added them to its round's sums, and a fresh tensor the size of a large fragment costs more in page faults
(about 5x an `add_` pass over it, measured on this machine) than decoding into memory already mapped.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence

import torch

from ddiloco.compression import Codec
from ddiloco.messages import DecodedTensor, RejectReason

MIN_FLOAT32_NORM = 1e-15
"""A float32-accumulated norm below this is recomputed in float64: its squares were near or below float32's
smallest normal number (1.2e-38), where they lose precision or flush to zero."""


def l2_norm(values: torch.Tensor) -> float:
    """||values||_2 as a Python float: inf or NaN when a value is not finite (see the module docstring)."""
    fast = float(torch.linalg.vector_norm(values))
    if MIN_FLOAT32_NORM <= fast < math.inf:
        return fast
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


def check_values(name: str, values: torch.Tensor) -> DecodedTensor | tuple[RejectReason, str]:
    """`values` with its norm, or (NON_FINITE, why) when a value is NaN or Inf."""
    norm = l2_norm(values)
    if not math.isfinite(norm):
        return RejectReason.NON_FINITE, f"{name} holds non-finite values (NaN or Inf)"
    return DecodedTensor(values, norm)


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
                   shapes: Mapping[str, tuple[int, ...]], *,
                   into: Sequence[torch.Tensor] = ()) -> dict[str, DecodedTensor] | tuple[RejectReason, str]:
    """The tensors `names` of `payload`, decoded and checked in that order; or (reason, detail) for the first
    that is malformed (wrong byte count) or not finite. `into`: one buffer per name to decode into (see
    `DecodeBuffers`; each of at least `codec.buffer_numel` values); none: new tensors."""
    decoded = {}
    for i, name in enumerate(names):
        try:
            values = codec.decode(payload[name], shapes[name], out=into[i] if into else None)
        except ValueError as exc:
            return RejectReason.MALFORMED, f"{name}: {exc}"
        checked = check_values(name, values)
        if isinstance(checked, tuple):
            return checked
        decoded[name] = checked
    return decoded
