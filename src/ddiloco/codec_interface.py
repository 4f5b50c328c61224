"""The `Codec` interface that every wire codec of `ddiloco.compression` implements, and what the codecs share.

This module owns the contract between a codec and its callers, not any byte format (those are
`ddiloco.compression`'s): `encode` refuses NaN and Inf with `NonFiniteError` (callers that prefer to zero them use
`zero_nonfinite` first); `decode` checks a payload's byte count against `encoded_nbytes` and a shape's
dimensions, and decodes into a new tensor or into a reused `out` buffer. The helpers here do those checks for
every codec: the tensor going in (floating point, flattened to float32, its absmax finite), the payload and the
shape coming out, and the `out` buffer.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ddiloco.checks import invalid


class NonFiniteError(ValueError):
    """`encode` got NaN or Inf values; `count` says how many (of `numel`)."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__(f"{count} of {numel} values are non-finite (NaN or Inf) and cannot be encoded; "
                         f"withhold the update or zero them with zero_nonfinite()")
        self.count = count
        self.numel = numel


class Codec(Protocol):
    """Encodes one tensor as bytes and back. Implementations are stateless and thread-compatible."""

    name: str

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Any floating dtype and shape (flattened row-major); raises NonFiniteError on NaN/Inf."""
        ...

    def decode(self, data: bytes, shape: tuple[int, ...], *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A float32 CPU tensor of `shape`; ValueError if len(data) != encoded_nbytes(numel). A new tensor, or with
        `out` (a contiguous float32 tensor of at least `buffer_numel(numel)` values, reused from call to call) a
        view of it: a fresh buffer the size of a large tensor costs more in page faults than decoding into it."""
        ...

    def buffer_numel(self, numel: int) -> int:
        """How many float32 values an `out` buffer for decoding `numel` values must hold."""
        ...

    def encoded_nbytes(self, numel: int) -> int:
        """Exactly len(encode(t)) for any t with t.numel() == numel."""
        ...

    def zero_layout(self, numel: int) -> tuple[int, int]:
        """(k, b): `encode` of `numel` zeros is k zero bytes (its scales), then byte b up to `encoded_nbytes`."""
        ...


def zero_nonfinite(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A copy of `tensor` with NaN and +-Inf set to 0, and how many values were replaced."""
    count = int(tensor.numel() - torch.isfinite(tensor).sum().item())
    return torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0), count


def flat_float32(tensor: torch.Tensor, *, device: torch.device | str | None = "cpu") -> torch.Tensor:
    """The values as one flat float32 tensor on `device` (None: where they are). A view, not a copy, when the input
    is already a contiguous float32 tensor there."""
    if not tensor.is_floating_point():
        raise TypeError(f"codecs encode floating-point tensors, got dtype {tensor.dtype}")
    return tensor.detach().to(device=tensor.device if device is None else device, dtype=torch.float32).reshape(-1)


def count_nonfinite(x: torch.Tensor) -> int:
    return int(x.numel() - torch.isfinite(x).sum().item())


def finite_absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar tensor; raises NonFiniteError. One reduction pass, no allocation
    (isfinite(x).all() would allocate n bools and is several times slower)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    lo, hi = torch.aminmax(x)  # NaN propagates into both, Inf into one
    absmax = torch.maximum(hi, lo.neg())
    if not math.isfinite(absmax.item()):
        raise NonFiniteError(count_nonfinite(x), x.numel())
    return absmax


def shape_numel(shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"shape {shape!r} must be a sequence of non-negative integers") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {shape!r} must be a sequence of non-negative integers")
    return dims, math.prod(dims)


def check_numel(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise invalid("numel", numel, "an integer >= 0")
    return numel


def checked_payload(codec: Codec, data: bytes, numel: int) -> np.ndarray:
    """A writable uint8 copy of `data` after checking its length; writable so that torch.from_numpy
    can share it without a warning, and a copy so the decoded tensor never aliases the caller's bytes."""
    got = memoryview(data).nbytes
    expected = codec.encoded_nbytes(numel)
    if got != expected:
        raise ValueError(f"{codec.name} payload for {numel} values must be {expected} bytes, got {got}")
    return np.frombuffer(bytearray(data), dtype=np.uint8)


def out_buffer(out: torch.Tensor | None, numel: int) -> torch.Tensor:
    """The first `numel` values of `out` (checked), or a new float32 tensor when there is none."""
    if out is None:
        return torch.empty(numel, dtype=torch.float32)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < numel or out.device.type != "cpu":
        raise TypeError(f"out must be a contiguous float32 CPU tensor of at least {numel} values, got "
                         f"{out.dtype} with {out.numel()} values")
    return out.view(-1)[:numel]


def write_into(out: torch.Tensor | None, decoded: torch.Tensor) -> torch.Tensor:
    """`decoded`, or its values copied into `out` (formats whose decoding allocates anyway)."""
    if out is None:
        return decoded
    return out_buffer(out, decoded.numel()).copy_(decoded.reshape(-1)).view(decoded.shape)
