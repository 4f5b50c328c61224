"""Wire codecs for pseudo-gradients and the downlink's fragment changes: tensor -> bytes -> float32 tensor.

This module owns the byte formats of one tensor on the wire and nothing else: it does not choose which
tensors to send, accumulate error, or check decoded values (see "Non-finite values" below). Codecs are
picked by name with `get_codec(name, **options)`; names are `CODEC_NAMES`. The `Codec` interface they implement,
and the checks of what goes in and comes out that they share, are `ddiloco.codec_interface`'s.

Why compress, and how far: in Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) int4 outer
gradients are nearly lossless (text accuracy 55.3 vs 55.4 for bf16) while int2 collapses (42.6).
Streaming DiLoCo (arXiv 2501.18512) sent 4-bit floats and accumulated in fp32. `int2` is here for that
ablation, not for use. Decoding always yields float32, so accumulation downstream is in fp32.

Byte layouts (all multi-byte numbers little-endian; every scale is an IEEE float32; n = numel):

    fp32   n x float32                                                  4n bytes, lossless
    bf16   n x bfloat16 (round to nearest even)                         2n bytes
    fp8    1 x float32 scale, then n x float8 e4m3fn codes              4 + n bytes
           scale = absmax / 448 (e4m3fn's largest finite value); value = code * scale
    int8   ceil(n/B) x float32 scales, then n bytes of codes           4 ceil(n/B) + n bytes
    int4   ceil(n/B) x float32 scales, then ceil(n/2) bytes of codes    4 ceil(n/B) + ceil(n/2) bytes
    int2   ceil(n/B) x float32 scales, then ceil(n/4) bytes of codes    4 ceil(n/B) + ceil(n/4) bytes

The tensor is flattened in row-major (C) order. int8, int4 and int2 are symmetric per-block quantizers:
the values are cut into blocks of B (`block_size`, default 256 for int8, 64 for int4 and int2)
consecutive values, the last block possibly shorter; block i has scale_i = absmax_i / L and each value x
becomes the integer q = clamp(round(x / scale_i), -L, L) (round half to even), sent as the unsigned code
q + 2^(bits-1). int8: L = 127, levels -127..127, codes 1..255, one byte per value (the downlink's codec:
`ddiloco.downlink`). int4: L = 7, levels -7..7, codes 1..15, value k of byte j is element 2j + k in bits
[4k, 4k + 4) (low nibble first). int2: L = 1, levels -1, 0, 1 (ternary; symmetric, so zero is exact and
no sign is favoured), codes 1..3, element 4j + k in bits [2k, 2k + 2). Decoding computes
(code - 2^(bits-1)) * scale, so code 0 (never written by `encode`) decodes to -128 * scale (int8), -8 *
scale (int4) or -2 * scale (int2). An all-zero block has scale 0 and decodes to exact zeros. Unused code
bits of the last byte (n not a multiple of 2 or 4) hold the code of zero and are ignored. No padding
values are sent: the byte counts above are exact and `encoded_nbytes` returns them.

Non-finite values: `encode` refuses NaN and Inf with `NonFiniteError` (carrying the count); callers that
prefer to zero them use `zero_nonfinite` first. Finite values beyond a format's range saturate (bf16 at
its largest finite value; fp8 by construction of the scale). `decode` checks only the byte count
(`ValueError` on a truncated or oversize payload) and never inspects values, so bytes that `encode`
never produces can decode to NaN or Inf: a non-finite scale (fp8, int8, int4, int2), a NaN code of fp8, or a
non-finite fp32/bf16 value. Callers check `torch.isfinite` on decoded tensors themselves.

Scales below float32's normal range (absmax under about 5e-36 for fp8, 8e-38 for int4, 1e-38 for int2)
lose precision or flush to zero; such pseudo-gradients carry nothing useful for training.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from ddiloco.checks import invalid
from ddiloco.codec_interface import (
    Codec,
    NonFiniteError,
    check_numel,
    checked_payload,
    count_nonfinite,
    finite_absmax,
    flat_float32,
    out_buffer,
    shape_numel,
    write_into,
)

FLOAT32_LE = np.dtype("<f4")
LITTLE_ENDIAN = sys.byteorder == "little"
INT16_LE = np.dtype("<i2")
SCALE_NBYTES = 4
"""Every scale travels as one float32."""
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""448: fp8 scales map a tensor's absmax here, using e4m3fn's full range."""
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
"""Finite float32 values above this would round to Inf in bfloat16, so bf16 saturates here."""
DEFAULT_BLOCK_SIZE = 64
"""Values per int4/int2 scale: 0.5 bits of scale overhead per value, 4.5 bits/value for int4."""
INT8_BLOCK_SIZE = 256
"""Values per int8 scale: 0.125 bits of scale overhead per value, 8.125 bits/value; int8's 255 levels
leave little to gain from following outliers more closely."""


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the CPU. Those on a GPU are copied into pinned host memory without blocking, all on the
    current stream, which is then waited for once: a background thread on a side stream waits for its own
    work only, never for the inner steps queued on the training stream."""
    cuda = [t for t in tensors if t.device.type == "cuda"]
    host = {id(t): torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in cuda}
    for device in {t.device for t in cuda}:
        torch.cuda.current_stream(device).synchronize()
    return tuple(host[id(t)] if id(t) in host else t.cpu() for t in tensors)  # .cpu(): no-op on the CPU


class Fp32Codec:
    """Raw float32: lossless, 32 bits/value. The identity codec, i.e. "compression off"."""

    name = "fp32"

    def buffer_numel(self, numel: int) -> int:
        return check_numel(numel)

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * check_numel(numel)

    def zero_layout(self, numel: int) -> tuple[int, int]:
        return 0, 0

    def encode(self, tensor: torch.Tensor) -> bytes:
        x = flat_float32(tensor)
        finite_absmax(x)
        return x.numpy().astype(FLOAT32_LE, copy=False).tobytes()

    def decode(self, data: bytes, shape: tuple[int, ...], *, out: torch.Tensor | None = None) -> torch.Tensor:
        dims, numel = shape_numel(shape)
        values = checked_payload(self, data, numel).view(FLOAT32_LE).astype(np.float32, copy=False)
        return write_into(out, torch.from_numpy(values).view(dims))


class Bf16Codec:
    """bfloat16, round to nearest even: relative error <= 2^-8, 16 bits/value."""

    name = "bf16"

    def buffer_numel(self, numel: int) -> int:
        return check_numel(numel)

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * check_numel(numel)

    def zero_layout(self, numel: int) -> tuple[int, int]:
        return 0, 0

    def encode(self, tensor: torch.Tensor) -> bytes:
        x = flat_float32(tensor)
        if finite_absmax(x).item() > BF16_MAX:
            x = x.clamp(-BF16_MAX, BF16_MAX)
        return x.to(torch.bfloat16).view(torch.int16).numpy().astype(INT16_LE, copy=False).tobytes()

    def decode(self, data: bytes, shape: tuple[int, ...], *, out: torch.Tensor | None = None) -> torch.Tensor:
        dims, numel = shape_numel(shape)
        bits = checked_payload(self, data, numel).view(INT16_LE).astype(np.int16, copy=False)
        return write_into(out, torch.from_numpy(bits).view(torch.bfloat16).to(torch.float32).view(dims))


class Fp8Codec:
    """float8 e4m3fn with one float32 scale per tensor (absmax -> 448): 8 bits/value + 32 bits.

    Error per value <= 2^-4 |x| (3 mantissa bits) + 2^-10 * scale (half the subnormal step), plus
    float32 rounding."""

    name = "fp8"

    def buffer_numel(self, numel: int) -> int:
        return check_numel(numel)

    def encoded_nbytes(self, numel: int) -> int:
        return SCALE_NBYTES + check_numel(numel)

    def zero_layout(self, numel: int) -> tuple[int, int]:
        return SCALE_NBYTES, 0  # a scale of 0, then e4m3fn's +0 codes

    def encode(self, tensor: torch.Tensor) -> bytes:
        x = flat_float32(tensor)
        scale = finite_absmax(x) / FP8_MAX  # float32, exactly the value sent
        out = np.empty(self.encoded_nbytes(x.numel()), dtype=np.uint8)
        out[:SCALE_NBYTES].view(FLOAT32_LE)[0] = scale.item()
        # x / scale <= 448 up to one float32 rounding, which e4m3fn rounds back to 448: no clamp needed.
        divisor = scale if scale.item() > 0 else torch.ones(())
        torch.from_numpy(out[SCALE_NBYTES:]).view(torch.float8_e4m3fn).copy_(x / divisor)
        return out.tobytes()

    def decode(self, data: bytes, shape: tuple[int, ...], *, out: torch.Tensor | None = None) -> torch.Tensor:
        dims, numel = shape_numel(shape)
        raw = checked_payload(self, data, numel)
        scale = float(raw[:SCALE_NBYTES].view(FLOAT32_LE)[0])
        codes = torch.from_numpy(raw[SCALE_NBYTES:]).view(torch.float8_e4m3fn)
        return write_into(out, codes.to(torch.float32).mul_(scale).view(dims))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8Config:
    """Options of the int8 codec."""

    block_size: int = INT8_BLOCK_SIZE
    """Consecutive values sharing one float32 scale; a positive integer."""

    def __post_init__(self) -> None:
        _check_block_size(self.block_size, values_per_byte=1, requirement="a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4Config:
    """Options of the int4 codec."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Consecutive values sharing one float32 scale; positive and even (two values per byte). Smaller
    blocks follow outliers more closely at 32 / block_size bits/value of scale overhead."""

    def __post_init__(self) -> None:
        _check_block_size(self.block_size, values_per_byte=2, requirement="a positive even integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int2Config:
    """Options of the int2 codec."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Consecutive values sharing one float32 scale; a positive multiple of 4 (four values per byte)."""

    def __post_init__(self) -> None:
        _check_block_size(self.block_size, values_per_byte=4, requirement="a positive multiple of 4")


def _check_block_size(block_size: int, *, values_per_byte: int, requirement: str) -> None:
    # A block boundary may never fall inside a byte, so padded blocks pack into whole bytes.
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0
            or block_size % values_per_byte):
        raise invalid("block_size", block_size, requirement)


class _BlockCodec:
    """Symmetric per-block integer quantization with `bits` bits per value (see the module docstring)."""

    name: str
    bits: int

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.levels = 2 ** (self.bits - 1) - 1  # largest |q|: 127 for int8, 7 for int4, 1 for int2
        self.offset = 2 ** (self.bits - 1)  # code = q + offset, so codes are unsigned
        self.values_per_byte = 8 // self.bits
        self.zero_code = sum(self.offset << (self.bits * k) for k in range(self.values_per_byte))
        """A byte whose every field holds the code of zero (padding fields too)."""

    def _counts(self, numel: int) -> tuple[int, int]:
        """(number of blocks, number of code bytes) for `numel` values."""
        return -(-numel // self.block_size), -(-numel // self.values_per_byte)

    def encoded_nbytes(self, numel: int) -> int:
        num_blocks, num_code_bytes = self._counts(check_numel(numel))
        return SCALE_NBYTES * num_blocks + num_code_bytes

    def buffer_numel(self, numel: int) -> int:
        return self._counts(check_numel(numel))[0] * self.block_size

    def zero_layout(self, numel: int) -> tuple[int, int]:
        return SCALE_NBYTES * -(-check_numel(numel) // self.block_size), self.zero_code  # scales of +0, then codes

    def encode(self, tensor: torch.Tensor) -> bytes:
        return self._quantize(tensor, None)[0]

    def encode_decoded(self, tensor: torch.Tensor, *, out: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """`encode(tensor)` and what `decode` gives of it, in `out` as `decode(..., out=out)` would (the same bits),
        without decoding: the levels, already in `out`, times their block's scale, the multiply `decode` does. Adding
        0.0 first turns a level of -0.0 (round of a small negative value) into the +0.0 that `decode`'s integer
        level gives, so that previous + decoded keeps the sign of a zero as every learner's rebuild does."""
        payload, levels, scale = self._quantize(tensor, out)
        levels.add_(0.0).view(-1, self.block_size).mul_(scale[:, None])
        return payload, levels[:tensor.numel()].view(tensor.shape)

    def _quantize(self, tensor: torch.Tensor, out: torch.Tensor | None) -> tuple[bytes, torch.Tensor, torch.Tensor]:
        """(the payload, the levels q as float32 padded to whole blocks with zeros, the scales). The levels are
        written into `out` (see `decode`) or a new tensor on the values' device."""
        # Quantised where the values are (a learner's GPU): only the scales and the packed codes, 4.5 bits a value
        # for int4 instead of 32, are copied to the host.
        x = flat_float32(tensor, device=None)
        numel, size = x.numel(), self.block_size
        num_blocks, num_code_bytes = self._counts(numel)
        num_full = numel // size
        head = num_full * size
        x_full = x[:head].view(num_full, size)

        absmax = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
        if num_full:  # amax and amin separately: aminmax(dim=1) is ~5x slower on short rows
            torch.maximum(x_full.amax(dim=1), x_full.amin(dim=1).neg_(), out=absmax[:num_full])
        if head < numel:
            absmax[num_full] = x[head:].abs().max()
        absmax.add_(0.0)  # an all-zero block's -0 (maximum(+0, -0) gives either, by vector width) becomes +0
        if not bool(torch.isfinite(absmax).all()):  # NaN and Inf propagate into their block's absmax
            raise NonFiniteError(count_nonfinite(x), numel)
        scale = absmax / self.levels
        divisor = torch.where(scale > 0, scale, 1.0)  # all-zero block: q = 0 instead of 0/0

        # (num_blocks * size,) padded working buffer of the levels q, as floats.
        if out is None:
            work = torch.empty(num_blocks * size, dtype=torch.float32, device=x.device)
        else:
            work = out_buffer(out, num_blocks * size)
        torch.div(x_full, divisor[:num_full, None], out=work[:head].view(num_full, size))
        if head < numel:
            torch.div(x[head:], divisor[num_full], out=work[head:numel])
            work[numel:].zero_()
        # clamp: x / scale can exceed L by a rounding, or by far when the scale is subnormal.
        work.round_().clamp_(-self.levels, self.levels)

        payload = np.empty(self.encoded_nbytes(numel), dtype=np.uint8)
        scale_nbytes = SCALE_NBYTES * num_blocks
        codes_out = torch.from_numpy(payload[scale_nbytes:])
        fields = work.view(-1, self.values_per_byte)  # (code bytes incl. padding, values per byte)
        if self.values_per_byte == 1:
            # q as an int8 byte, then the code q + 128 by flipping its top bit (two's complement): exact.
            codes = fields[:num_code_bytes, 0]
            if codes.device.type != "cpu":
                codes = codes.to(torch.int8)  # a quarter of the bytes of the floats cross to the host
        else:
            packed = torch.add(fields[:, 0], fields[:, 1], alpha=2**self.bits)
            for k in range(2, self.values_per_byte):
                packed.add_(fields[:, k], alpha=2 ** (self.bits * k))
            # Every field's offset at once, on the packed bytes: sum_k (q_k + offset) 2^(bits k), exact in float32.
            packed.add_(self.offset * sum(2 ** (self.bits * k) for k in range(self.values_per_byte)))
            codes = packed[:num_code_bytes]
            if codes.device.type != "cpu":
                codes = codes.to(torch.uint8)  # exact: integers <= 255; a quarter of the bytes of the floats
        host_scale, host_codes = to_host(scale, codes)
        payload[:scale_nbytes].view(FLOAT32_LE)[:] = host_scale.numpy()
        if self.values_per_byte == 1:
            codes_out.view(torch.int8).copy_(host_codes)
            codes_out.bitwise_xor_(self.offset)
        else:
            codes_out.copy_(host_codes)  # exact: integers <= 255
        return payload.tobytes(), work, scale

    def decode(self, data: bytes, shape: tuple[int, ...], *, out: torch.Tensor | None = None) -> torch.Tensor:
        dims, numel = shape_numel(shape)
        raw = checked_payload(self, data, numel)
        num_blocks, _ = self._counts(numel)
        scale_nbytes = SCALE_NBYTES * num_blocks
        scale = torch.from_numpy(raw[:scale_nbytes].view(FLOAT32_LE).astype(np.float32, copy=False))
        levels = self._levels(torch.from_numpy(raw[scale_nbytes:]))

        # Padded to whole blocks; the result is a view of its first numel values (no copy to trim). Each value is
        # float32(level) * scale: the levels widened in one pass, then scaled in place (twice as fast as one
        # mixed-type multiply, which torch does not vectorise).
        out = out_buffer(out, num_blocks * self.block_size)
        out[:numel].copy_(levels[:numel])
        out[numel:].zero_()
        out.view(num_blocks, self.block_size).mul_(scale[:, None])
        return out[:numel].view(dims)

    def _levels(self, codes: torch.Tensor) -> torch.Tensor:
        """The levels q = code - offset of the packed `codes` (uint8, writable), as int8: `values_per_byte` per byte."""
        mask = 2**self.bits - 1
        levels = torch.empty(codes.numel() * self.values_per_byte, dtype=torch.int8)
        fields = levels.view(-1, self.values_per_byte)
        for k in range(self.values_per_byte):
            fields[:, k].copy_((codes >> (self.bits * k)).bitwise_and_(mask).view(torch.int8))
        return levels.sub_(self.offset)


class Int8Codec(_BlockCodec):
    """Symmetric int8, levels -127..127, one float32 scale per block: 8.125 bits/value at block size 256.
    Error per value <= scale / 2 = absmax_block / 254, plus float32 rounding."""

    name = "int8"
    bits = 8

    def __init__(self, config: Int8Config | None = None) -> None:
        self.config = config or Int8Config()
        super().__init__(self.config.block_size)

    def _levels(self, codes: torch.Tensor) -> torch.Tensor:
        # code - 128 does not fit int8 arithmetic for codes >= 128; flipping the top bit gives the same
        # value as a two's complement byte, exactly (in place: the codes are the payload's own copy).
        return codes.bitwise_xor_(self.offset).view(torch.int8)


class Int4Codec(_BlockCodec):
    """Symmetric int4, levels -7..7, one float32 scale per block: 4.5 bits/value at block size 64.
    Error per value <= scale / 2 = absmax_block / 14, plus float32 rounding."""

    name = "int4"
    bits = 4

    def __init__(self, config: Int4Config | None = None) -> None:
        self.config = config or Int4Config()
        super().__init__(self.config.block_size)

    def _levels(self, codes: torch.Tensor) -> torch.Tensor:
        # Both nibbles of a byte at once, in contiguous passes: byte c widened to 16 bits becomes
        # (c | c << 4) & 0x0F0F, whose two bytes (little-endian) are the low and the high code. 4x faster than
        # writing every other int8 of the levels (a strided copy). The byte order is the host's.
        if not LITTLE_ENDIAN:
            return super()._levels(codes)
        words, shifted = torch.empty(2 * codes.numel(), dtype=torch.int16).view(2, -1)
        words.copy_(codes)
        words.bitwise_or_(torch.bitwise_left_shift(words, 4, out=shifted)).bitwise_and_(0x0F0F)
        return words.view(torch.int8).sub_(self.offset)


class Int2Codec(_BlockCodec):
    """Symmetric ternary int2, levels -1, 0, 1, one float32 scale (= block absmax) per block: 2.5
    bits/value at block size 64. Kept for the ablation that shows it is too lossy."""

    name = "int2"
    bits = 2

    def __init__(self, config: Int2Config | None = None) -> None:
        self.config = config or Int2Config()
        super().__init__(self.config.block_size)


_CODECS: dict[str, tuple[type, type | None]] = {
    "fp32": (Fp32Codec, None),
    "bf16": (Bf16Codec, None),
    "fp8": (Fp8Codec, None),
    "int8": (Int8Codec, Int8Config),
    "int4": (Int4Codec, Int4Config),
    "int2": (Int2Codec, Int2Config),
}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def encode_decoded(codec: Codec, tensor: torch.Tensor, *, out: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """`codec.encode(tensor)` and the values `codec.decode` gives of it (into `out`, as `decode(..., out=out)`):
    the block codecs compute them while encoding, the others decode their own payload."""
    fused = getattr(codec, "encode_decoded", None)
    if fused is not None:
        return fused(tensor, out=out)
    payload = codec.encode(tensor)
    return payload, codec.decode(payload, tuple(tensor.shape), out=out)


def get_codec(name: str, **options: object) -> Codec:
    """The codec called `name`, built with `options` (fields of its config, e.g. block_size=32)."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}: valid names are {', '.join(CODEC_NAMES)}")
    codec_cls, config_cls = _CODECS[name]
    if config_cls is None:
        if options:
            raise ValueError(f"codec {name!r} takes no options, got {', '.join(sorted(options))}")
        return codec_cls()
    valid = sorted(field.name for field in dataclasses.fields(config_cls))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"codec {name!r} has no option {', '.join(unknown)}: valid options are "
                         f"{', '.join(valid)}")
    return codec_cls(config_cls(**options))
