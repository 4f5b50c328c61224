import math
import struct

import numpy as np
import pytest
import torch

from ddiloco.codec_interface import NonFiniteError, zero_nonfinite
from ddiloco.compression import (
    CODEC_NAMES,
    Int2Config,
    Int4Config,
    Int8Config,
    encode_decoded,
    get_codec,
)

EPS32 = 2.0**-23  # float32 machine epsilon: one rounding costs at most EPS32 / 2 relative
LEVELS = {"int8": 127, "int4": 7, "int2": 1}
DEFAULT_BLOCK = {"int8": 256, "int4": 64, "int2": 64}


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / x.norm())


def expected_nbytes(name: str, numel: int, block_size: int | None = None) -> int:
    blocks = math.ceil(numel / (block_size or DEFAULT_BLOCK.get(name, 1)))
    return {"fp32": 4 * numel, "bf16": 2 * numel, "fp8": 4 + numel, "int8": 4 * blocks + numel,
            "int4": 4 * blocks + math.ceil(numel / 2), "int2": 4 * blocks + math.ceil(numel / 4)}[name]


def test_fp32_round_trip_is_exact():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=generator) * 1e3
    codec = get_codec("fp32")
    assert torch.equal(codec.decode(codec.encode(x), x.shape), x)


def test_bf16_relative_error_is_at_most_2_pow_minus_8():
    # bf16 keeps 8 significant bits; round to nearest costs at most half a unit in the last place.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=generator) * torch.exp(4 * torch.randn(4000, generator=generator))
    codec = get_codec("bf16")
    y = codec.decode(codec.encode(x), x.shape)
    assert bool(((y - x).abs() <= 2.0**-8 * x.abs()).all())
    assert not torch.equal(x, y)


def test_bf16_saturates_instead_of_overflowing():
    x = torch.tensor([3.4e38, -3.4e38, 1.0])
    codec = get_codec("bf16")
    y = codec.decode(codec.encode(x), x.shape)
    assert bool(torch.isfinite(y).all())
    assert float(y[0]) == float(torch.finfo(torch.bfloat16).max) == -float(y[1])


def test_fp8_error_within_derived_bound():
    # Scaled value v = x / s (s = absmax / 448). e4m3 keeps 4 significant bits on normals (|v| >= 2^-6),
    # so rounding costs <= 2^-4 |v|; below that the step is 2^-9, so rounding costs <= 2^-10. Back in
    # x's units: |x - y| <= 2^-4 |x| + 2^-10 s, plus three float32 roundings (x / s, code * s).
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4000, generator=generator) * torch.exp(3 * torch.randn(4000, generator=generator))
    codec = get_codec("fp8")
    data = codec.encode(x)
    scale = struct.unpack("<f", data[:4])[0]
    assert scale == float(x.abs().max() / 448)
    y = codec.decode(data, x.shape)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale + 2 * EPS32 * x.abs()
    assert bool(((y - x).abs() <= bound).all())
    assert float(y.abs().max()) == float(x.abs().max())  # absmax maps to 448 exactly and back


@pytest.mark.parametrize("name, block_size", [("int8", 256), ("int8", 33), ("int4", 64), ("int4", 32), ("int2", 64),
                                              ("int2", 32)])
def test_block_codecs_match_reference_arithmetic(name, block_size):
    generator = torch.Generator().manual_seed(3)
    numel = 1000  # not a multiple of either block size: the last block is partial
    x = torch.randn(numel, generator=generator) * torch.exp(torch.randn(numel, generator=generator))
    x[128:192] = 0.0  # whole zero blocks
    codec = get_codec(name, block_size=block_size)
    data = codec.encode(x)
    y = codec.decode(data, x.shape)

    levels = LEVELS[name]
    blocks = math.ceil(numel / block_size)
    x_blocks = torch.cat([x, torch.zeros(blocks * block_size - numel)]).view(blocks, block_size)
    absmax = x_blocks.abs().amax(dim=1)
    scale = absmax / levels  # float32, as sent
    assert np.array_equal(np.frombuffer(data[:4 * blocks], "<f4"), scale.numpy())
    # Reference quantization in float64.
    s64 = scale.double()[:, None]
    ratio = torch.where(s64 > 0, x_blocks.double() / s64, 0.0)
    reference = (ratio.round().clamp(-levels, levels) * s64).flatten()[:numel]
    scale_each = s64.expand(-1, block_size).flatten()[:numel]
    absmax_each = absmax.double()[:, None].expand(-1, block_size).flatten()[:numel]

    rounding_slack = 2 * EPS32 * absmax_each  # float32 rounding of x / s and of q * s
    assert bool(((y.double() - x.double()).abs() <= scale_each / 2 + rounding_slack).all())
    # The codes agree with the reference except, possibly, within float32 rounding of a tie.
    near_tie = ((ratio.flatten()[:numel].abs().frac() - 0.5).abs() < 1e-5)
    agrees = (y.double() - reference).abs() <= rounding_slack
    assert bool((agrees | near_tie).all())
    assert bool((y[128:192] == 0).all())


def test_int8_byte_layout_by_hand():
    # Block size 4, absmax 127 -> scale 1; q = 127, -127, 0, -1 -> codes 255, 1, 128, 127. The second
    # block (one value, absmax 2.54 -> scale 0.02): q = 127 -> code 255.
    codec = get_codec("int8", block_size=4)
    data = codec.encode(torch.tensor([127.0, -127.0, 0.0, -1.0, 2.54]))
    assert data == struct.pack("<ff", 1.0, 2.54 / 127) + bytes([255, 1, 128, 127, 255])
    assert torch.equal(codec.decode(data, (5,))[:4], torch.tensor([127.0, -127.0, 0.0, -1.0]))


def test_int8_error_is_at_most_half_a_step_and_far_below_int4():
    x = torch.randn(256 * 64, generator=torch.Generator().manual_seed(10))
    codec = get_codec("int8")
    y = codec.decode(codec.encode(x), x.shape)
    step = x.view(64, 256).abs().amax(dim=1, keepdim=True).expand(-1, 256).reshape(-1) / 127
    assert bool(((y - x).abs() <= step / 2 + 2 * EPS32 * x.abs().max()).all())
    int4 = get_codec("int4")
    assert relative_error(x, y) * 8 < relative_error(x, int4.decode(int4.encode(x), x.shape))


def test_int4_byte_layout_by_hand():
    # Block size 4, absmax 7 -> scale 1; q = 7, -7, 0, 1 -> codes 15, 1, 8, 9, low nibble first.
    codec = get_codec("int4", block_size=4)
    data = codec.encode(torch.tensor([7.0, -7.0, 0.0, 1.0, 0.0, 0.0]))
    assert data == struct.pack("<ff", 1.0, 0.0) + bytes([0x1F, 0x98, 0x88])


def test_int4_odd_length_sends_no_padding():
    codec = get_codec("int4", block_size=4)
    # One block of 3 values (absmax 7): codes 15, 8, 1; the unused high nibble holds the code of zero.
    data = codec.encode(torch.tensor([7.0, 0.0, -7.0]))
    assert data == struct.pack("<f", 1.0) + bytes([0x8F, 0x81])
    assert torch.equal(codec.decode(data, (3,)), torch.tensor([7.0, 0.0, -7.0]))


def test_int2_byte_layout_by_hand():
    # Ternary, absmax 2 -> scale 2; q = 1, -1, 0, 0 (0.8 / 2 rounds to 0) -> codes 3, 1, 2, 2, lowest
    # bits first. The second block holds one value; the rest of its byte holds the code of zero.
    codec = get_codec("int2", block_size=4)
    data = codec.encode(torch.tensor([2.0, -2.0, 0.0, 0.8, 2.0]))
    codes = bytes([3 | 1 << 2 | 2 << 4 | 2 << 6, 3 | 2 << 2 | 2 << 4 | 2 << 6])
    assert data == struct.pack("<ff", 2.0, 2.0) + codes
    assert torch.equal(codec.decode(data, (5,)), torch.tensor([2.0, -2.0, 0.0, 0.0, 2.0]))


def test_fp8_byte_layout_by_hand():
    # absmax 448 -> scale 1; e4m3fn: 448 = 0x7E, -1 = 0xB8, 0.5 = 0x30.
    data = get_codec("fp8").encode(torch.tensor([448.0, -1.0, 0.5]))
    assert data == struct.pack("<f", 1.0) + bytes([0x7E, 0xB8, 0x30])


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 5, 31, 63, 64, 65, 127, 1000])
def test_encoded_nbytes_is_exact(name, numel):
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    assert codec.encoded_nbytes(numel) == expected_nbytes(name, numel) == len(codec.encode(x))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 100])
def test_encoded_nbytes_is_exact_at_block_size_32(name, numel):
    codec = get_codec(name, block_size=32)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    assert codec.encoded_nbytes(numel) == expected_nbytes(name, numel, 32) == len(codec.encode(x))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_rejects_wrong_length(name):
    codec = get_codec(name)
    data = codec.encode(torch.randn(65, generator=torch.Generator().manual_seed(4)))
    expected = len(data)
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(ValueError, match=f"must be {expected} bytes, got {len(bad)}"):
            codec.decode(bad, (65,))
    with pytest.raises(ValueError, match="shape"):
        codec.decode(data, (-1, 65))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_rejects_nonfinite_with_count(name):
    x = torch.randn(100, generator=torch.Generator().manual_seed(5))
    x[[3, 50]] = float("nan")
    x[70] = float("inf")
    x[99] = -float("inf")  # in the partial last block of the block codecs at block size 64
    with pytest.raises(NonFiniteError, match="4 of 100 values are non-finite") as info:
        get_codec(name).encode(x)
    assert info.value.count == 4
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_rejects_float64_that_overflows_float32(name):
    with pytest.raises(NonFiniteError) as info:
        get_codec(name).encode(torch.tensor([1.0, 1e300], dtype=torch.float64))
    assert info.value.count == 1


def test_zero_nonfinite_zeroes_a_copy_and_counts():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.0])
    cleaned, count = zero_nonfinite(x)
    assert count == 3
    assert torch.equal(cleaned, torch.tensor([1.0, 0.0, 0.0, 0.0, -2.0]))
    assert bool(torch.isnan(x[1]))  # the input is untouched
    assert zero_nonfinite(torch.ones(4))[1] == 0


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zero_tensor_round_trips_to_exact_zeros(name):
    codec = get_codec(name)
    y = codec.decode(codec.encode(torch.zeros(4, 33)), (4, 33))
    assert torch.equal(y, torch.zeros(4, 33))


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 5, 7), (2, 0, 4), (129,)])
def test_shapes_and_dtype_preserved(name, shape):
    codec = get_codec(name)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    y = codec.decode(codec.encode(x), shape)
    assert y.shape == torch.Size(shape)
    assert y.dtype == torch.float32


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_float_dtypes_encode_like_their_float32_values(name, dtype):
    x = torch.randn(200, generator=torch.Generator().manual_seed(7)).to(dtype)
    codec = get_codec(name)
    assert codec.encode(x) == codec.encode(x.to(torch.float32))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_contiguous_input_encodes_like_its_contiguous_copy(name):
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(8)).t()
    codec = get_codec(name)
    assert codec.encode(x) == codec.encode(x.contiguous())


def test_integer_tensors_are_refused():
    with pytest.raises(TypeError, match="floating-point"):
        get_codec("int4").encode(torch.arange(10))


def test_int2_is_much_worse_than_int4_on_gaussian_data():
    x = torch.randn(64 * 256, generator=torch.Generator().manual_seed(9))
    errors = {}
    for name in ("int4", "int2", "fp8", "bf16"):
        codec = get_codec(name)
        errors[name] = relative_error(x, codec.decode(codec.encode(x), x.shape))
    # Gaussian blocks of 64 have absmax ~2.4 sigma: int4's step is ~0.35 sigma, int2 zeroes |x| < 1.2 sigma.
    assert errors["bf16"] < errors["fp8"] < errors["int4"] < 0.15
    assert errors["int2"] > 0.5
    assert errors["int2"] > 4 * errors["int4"]


def test_bad_codec_name_lists_the_valid_names():
    with pytest.raises(ValueError) as info:
        get_codec("int3")
    message = str(info.value)
    assert "'int3'" in message
    assert all(name in message for name in CODEC_NAMES)


def test_codec_options_are_validated():
    assert get_codec("int4", block_size=32).encoded_nbytes(64) == 8 + 32
    with pytest.raises(ValueError, match="block_size=3"):
        get_codec("int4", block_size=3)
    with pytest.raises(ValueError, match="block_size=0"):
        Int4Config(block_size=0)
    with pytest.raises(ValueError, match="block_size=6"):
        Int2Config(block_size=6)
    with pytest.raises(ValueError, match="block_size=0"):
        Int8Config(block_size=0)
    assert get_codec("int8", block_size=3).encoded_nbytes(7) == 3 * 4 + 7
    with pytest.raises(ValueError, match="no option bits"):
        get_codec("int4", bits=3)
    with pytest.raises(ValueError, match="takes no options"):
        get_codec("fp32", block_size=64)
    with pytest.raises(ValueError, match="numel"):
        get_codec("int4").encoded_nbytes(-1)


@pytest.mark.parametrize("name, block_size", [("int8", 256), ("int8", 33), ("int4", 64), ("int4", 32), ("int2", 64)])
@pytest.mark.parametrize("numel", [1, 2, 3, 63, 64, 65, 1000])
def test_encode_decoded_gives_the_payload_and_the_bits_decode_gives(name, block_size, numel):
    # The syncer's downlink takes the values every learner rebuilds from encode_decoded, without decoding: they
    # must be the very bits decode(payload) gives, tails, zero blocks and subnormal scales included.
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator) * torch.exp(3 * torch.randn(numel, generator=generator))
    x[: min(numel, block_size)] *= 1e-39  # a block with a subnormal scale
    x[block_size:2 * block_size] = 0.0  # a whole zero block (where there is one)
    x[2 * block_size:3 * block_size] = -0.0  # and one of negative zeros
    x[3 * block_size:4 * block_size] = -1e-30  # tiny negative values in a block of larger ones: levels -0.0
    x[3 * block_size:3 * block_size + 1] = 1.0
    codec = get_codec(name, block_size=block_size)
    out = torch.full((codec.buffer_numel(numel) + 5,), 3.0)
    payload, values = encode_decoded(codec, x.view(1, -1), out=out)
    assert payload == codec.encode(x)
    assert values.shape == (1, numel) and values.data_ptr() == out.data_ptr()
    decoded = codec.decode(payload, (numel,), out=torch.full((codec.buffer_numel(numel),), 5.0))
    assert torch.equal(values.view(-1), decoded)
    assert torch.equal(values.view(-1).view(torch.int32), decoded.view(torch.int32))  # -0.0 and +0.0 apart


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp8"])
def test_encode_decoded_of_other_codecs_decodes_their_payload(name):
    x = torch.randn(100, generator=torch.Generator().manual_seed(4))
    codec = get_codec(name)
    payload, values = encode_decoded(codec, x, out=torch.empty(codec.buffer_numel(100)))
    assert payload == codec.encode(x) and torch.equal(values, codec.decode(payload, (100,)))


def test_int4_levels_agree_with_the_byte_order_free_unpacking():
    # int4 unpacks both nibbles of a byte through one 16-bit word (little-endian hosts); the generic unpacking
    # (every field on its own, used on other hosts and by int2) must give the same levels for every byte value.
    codec = get_codec("int4")
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(3)
    fast = codec._levels(every_byte.clone())
    generic = super(type(codec), codec)._levels(every_byte.clone())
    assert torch.equal(fast, generic)
    assert fast.dtype == torch.int8 and fast.numel() == 2 * every_byte.numel()
    assert fast[:4].tolist() == [-8, -8, -7, -8] and fast[2 * 0xF1:2 * 0xF1 + 2].tolist() == [-7, 7]
