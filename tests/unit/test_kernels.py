"""The syncer's kernels (`ddiloco.kernels`) against the arithmetic docs/protocol.md states, written out here with numpy:
norms in their fixed order, sums with two roundings, the fused close; tails that are not a whole chunk or block,
non-finite values and scales, zeros; the compiled and the eager path give the same bits, on any number of threads."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from ddiloco import checksums, kernels
from ddiloco.compression import Int4Codec, Int4Config, Int8Codec
from ddiloco.kernel_threads import MIN_SPLIT, KernelThreads
from ddiloco.kernels import CloseTensor, Int4Blocks

compiled_only = pytest.mark.skipif(kernels.compiled is None, reason="ddiloco._kernels is not built")
SIZES = [0, 1, 15, 17, 1000, 65536, 65537, 3 * 65536 + 333]


def stated_square_sum(values: np.ndarray) -> float:
    """Chunks of 65,536 values; per chunk 16 float64 lanes of exact squares (value i to lane i % 16), each summed in
    order; the lanes in order; the chunks in order."""
    total = 0.0
    for start in range(0, values.size, 65536):
        chunk = values[start:start + 65536].astype(np.float64)
        padded = np.zeros(-(-chunk.size // 16) * 16)
        padded[:chunk.size] = chunk
        lanes = np.cumsum(padded.reshape(-1, 16) ** 2, axis=0)[-1]  # np.cumsum adds in order
        chunk_total = 0.0
        for lane in lanes.tolist():
            chunk_total += lane
        total += chunk_total
    return total


def _values(numel: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("scale", [1.0, 1e20, 1e-25])  # squares past float32's range and into its subnormals
def test_the_norm_is_the_stated_sum_of_squares(numel, scale):
    values = _values(numel, seed=numel, scale=scale)
    assert kernels.square_sum(values) == stated_square_sum(values.numpy())
    assert kernels.l2_norm(values) == math.sqrt(stated_square_sum(values.numpy()))
    assert kernels._eager_square_sum(values) == stated_square_sum(values.numpy())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_norm_is_not_finite_exactly_when_a_value_is_not(bad):
    values = _values(3 * 65536 + 5, seed=1)
    assert math.isfinite(kernels.l2_norm(values))
    for where in (0, 65536 + 7, values.numel() - 1):  # first chunk, a later one, the tail
        spoiled = values.clone()
        spoiled[where] = bad
        assert not math.isfinite(kernels.l2_norm(spoiled))
    assert kernels.l2_norm(torch.zeros(70000)) == 0.0


def _int4(numel: int, block_size: int, seed: int) -> tuple[bytes, Int4Codec]:
    codec = Int4Codec(Int4Config(block_size=block_size))
    values = _values(numel, seed)
    if numel > 200:
        values[64:192] = 0.0  # all-zero blocks: scale 0
    return codec.encode(values), codec


@pytest.mark.parametrize("numel", [1, 17, 1001, 65537, 2 * 65536 + 99])
@pytest.mark.parametrize("block_size", [64, 6])  # 6 does not divide a chunk: blocks straddle chunks
def test_int4_values_are_read_from_their_codes_as_decode_gives_them(numel, block_size):
    payload, codec = _int4(numel, block_size, seed=numel)
    blocks = Int4Blocks(payload, numel, block_size)
    decoded = codec.decode(payload, (numel,))
    assert torch.equal(_bits(blocks.decode()), _bits(decoded))
    assert kernels.square_sum(blocks) == stated_square_sum(decoded.numpy())
    acc, expected = torch.full((numel,), 0.25), torch.full((numel,), 0.25)
    kernels.accumulate(acc, blocks, 0.3, first=False)
    expected = expected + decoded * 0.3
    assert torch.equal(_bits(acc), _bits(expected))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_int4_scale_makes_the_norm_not_finite(bad):
    payload, _ = _int4(1000, 64, seed=3)
    scales = np.frombuffer(payload, dtype="<f4", count=16).copy()
    scales[9] = bad
    spoiled = scales.tobytes() + payload[64:]
    assert not math.isfinite(kernels.l2_norm(Int4Blocks(spoiled, 1000, 64)))


@pytest.mark.parametrize("numel", SIZES[1:])
def test_sums_round_the_product_then_the_sum(numel):
    x, acc = _values(numel, seed=5), _values(numel, seed=6)
    alpha = 0.123456789123  # rounded to float32 first, as torch rounds a scalar
    a32 = np.float32(alpha)
    expected = acc.numpy() + x.numpy() * a32  # numpy float32: each operation rounded once
    first = x.numpy() * a32
    kernels.accumulate(acc, x, alpha, first=False)
    assert np.array_equal(acc.numpy().view(np.int32), expected.view(np.int32))
    kernels.accumulate(acc, x, alpha, first=True)
    assert np.array_equal(acc.numpy().view(np.int32), first.view(np.int32))


def test_the_eager_sums_round_as_the_kernels_do(monkeypatch):
    numel = 3 * 65536 + 17
    payload, codec = _int4(numel, 64, seed=12)
    x, start = _values(numel, seed=13), _values(numel, seed=14)
    a32 = np.float32(0.3141592653589)
    expected = (start.numpy() + x.numpy() * a32) + codec.decode(payload, (numel,)).numpy() * a32
    monkeypatch.setattr(kernels, "compiled", None)
    acc = start.clone()
    kernels.accumulate(acc, x, 0.3141592653589, first=False)
    kernels.accumulate(acc, Int4Blocks(payload, numel, 64), 0.3141592653589, first=False)
    assert np.array_equal(acc.numpy().view(np.int32), expected.view(np.int32))
    decoded = codec.decode(payload, (numel,)).numpy()
    assert kernels.square_sum(Int4Blocks(payload, numel, 64)) == stated_square_sum(decoded)


@pytest.mark.parametrize("compiled", [True, False])
def test_the_merge_scales_a_sum_as_torch_mul_and_div_by_a_scalar_do(monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr(kernels, "compiled", None)
    elif kernels.compiled is None:
        pytest.skip("ddiloco._kernels is not built")
    x, y = _values(3 * 65536 + 5, seed=15), _values(1001, seed=16)
    factor = 0.1234567891234  # rounded to float32, then one rounding per value
    expected_x, expected_y = x.numpy() * np.float32(factor), y.numpy() / np.float32(factor)
    kernels.scale_all([(x, factor, False), (y, factor, True)])
    assert np.array_equal(x.numpy().view(np.int32), expected_x.view(np.int32))
    assert np.array_equal(y.numpy().view(np.int32), expected_y.view(np.int32))


def test_a_fused_multiply_add_would_give_other_bits():
    # The reason for the stated roundings: torch's add_(alpha=) fuses on AVX2 CPUs, so the two differ somewhere.
    x, acc = _values(100000, seed=7), _values(100000, seed=8)
    fused = (acc.double() + x.double() * float(np.float32(0.7123))).float()
    kernels.accumulate(acc, x, 0.7123, first=False)
    assert not torch.equal(acc, fused)


@compiled_only
def test_the_bits_do_not_depend_on_the_number_of_threads():
    numel = 3 * MIN_SPLIT + 3  # large enough that 2 and 3 threads really cut it (one range per thread)
    payload, _ = _int4(numel, 64, seed=9)
    blocks = Int4Blocks(payload, numel, 64)
    x = _values(numel, seed=10)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            pool = KernelThreads()
            assert len(pool.split(numel, kernels.NORM_CHUNK)) == threads
            acc = torch.zeros(numel)
            kernels.accumulate(acc, blocks, 0.5, first=True, threads=pool)
            kernels.accumulate(acc, x, 0.25, first=False, threads=pool)
            results.append((kernels.square_sum(blocks, pool), kernels.square_sum(x, pool), acc))
            pool.close()
    finally:
        torch.set_num_threads(before)
    for norm_blocks, norm_x, acc in results[1:]:
        assert (norm_blocks, norm_x) == results[0][:2] and torch.equal(_bits(acc), _bits(results[0][2]))


def stated_close(g, m, p, r, *, lr, mu, first_step, block_size):
    """The fused close written out with torch's float32 operations (each rounded once) and the int8 codec."""
    update = g
    momentum = None
    if mu:
        momentum = g.clone() if first_step else m * mu + g
        update = g + momentum * mu
    stepped = p - update * lr
    change = (stepped - p) + r
    codec = Int8Codec()
    assert codec.block_size == block_size
    payload = codec.encode(change)
    decoded = codec.decode(payload, tuple(change.shape))
    return momentum, p + decoded, change - decoded, payload


@compiled_only
@pytest.mark.parametrize("numel", [1, 255, 257, 70000])
@pytest.mark.parametrize(("mu", "first_step"), [(0.9, False), (0.9, True), (0.0, False)])
def test_the_fused_close_is_the_outer_step_then_the_int8_change(numel, mu, first_step):
    g, m, p, r = (_values(numel, seed=s, scale=x) for s, x in ((11, 1e-3), (12, 1e-3), (13, 1.0), (14, 1e-5)))
    g[: min(numel, 300)] = 0.0  # a whole zero block where there is one (scale 0, a change of the residual alone)
    r[: min(numel, 256)] = 0.0
    expected = stated_close(g, m, p, r, lr=0.7, mu=mu, first_step=first_step, block_size=256)
    out = np.empty(Int8Codec().encoded_nbytes(numel), dtype=np.uint8)
    momentum = (torch.full_like(m, math.nan) if first_step else m.clone()) if mu else None
    param, residual = p.clone(), r.clone()
    step = dict(lr=0.7, mu=mu, block_size=256)
    (checked,) = kernels.nesterov_int8([CloseTensor(g, momentum, param, residual, first_step, None)], **step)
    (written,) = kernels.nesterov_int8([CloseTensor(g, momentum, param, residual, first_step, out)], **step)
    assert checked.flags == 0 and written.flags == 0
    assert out.tobytes() == expected[3]
    assert torch.equal(_bits(param), _bits(expected[1])) and torch.equal(_bits(residual), _bits(expected[2]))
    if mu:
        assert torch.equal(_bits(momentum), _bits(expected[0]))
    assert written.momentum_max == (float(momentum.abs().max()) if mu else 0.0)
    assert (written.param_max, written.residual_max) == (float(param.abs().max()), float(residual.abs().max()))


@compiled_only
def test_a_close_batch_on_threads_writes_what_each_tensor_alone_on_one_thread_writes():
    sizes = [2 * MIN_SPLIT + 300, 1000, 0, 3 * 65536]  # the first cut in two ranges on 2 threads
    tensors = [[_values(n, seed=20 + 4 * k + j, scale=x) for j, x in enumerate((1e-3, 1e-3, 1.0, 1e-5))]
               for k, n in enumerate(sizes)]

    def close(threads: KernelThreads, batch: bool):
        states = [[t.clone() for t in group] for group in tensors]
        outs = [np.empty(Int8Codec().encoded_nbytes(n), dtype=np.uint8) for n in sizes]
        closes = [CloseTensor(g, m, p, r, False, out) for (g, m, p, r), out in zip(states, outs, strict=True)]
        step = dict(lr=0.7, mu=0.9, block_size=256, threads=threads)
        results = (kernels.nesterov_int8(closes, **step) if batch
                   else [kernels.nesterov_int8([c], **step)[0] for c in closes])
        return states, [o.tobytes() for o in outs], results

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        pool = KernelThreads()
        assert len(pool.split(sizes[0], kernels.NORM_CHUNK)) == 2
        one = close(KernelThreads(max_threads=1), batch=False)
        two = close(pool, batch=True)
        pool.close()
    finally:
        torch.set_num_threads(before)
    assert one[1] == two[1] and one[2] == two[2]
    for a, b in zip(one[0], two[0], strict=True):
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True))


@compiled_only
def test_the_close_check_finds_a_step_or_a_change_that_is_not_finite_and_writes_nothing():
    numel = 1000
    g, m, r = _values(numel, seed=15, scale=1e-3), _values(numel, seed=16, scale=1e-3), torch.zeros(numel)
    p = _values(numel, seed=17)
    p[600] = 3.0e38  # p' stays finite; p' - p is fine; a huge merged value overflows the step
    g_big = g.clone()
    g_big[600] = -3.0e38
    kept = p.clone()
    def check(g, m, p, r):
        (result,) = kernels.nesterov_int8([CloseTensor(g, m, p, r, False, None)], lr=0.7, mu=0.9, block_size=256)
        return result.flags

    assert check(g_big, m.clone(), p, r) & kernels.STEP_NOT_FINITE
    g2, m2, r2 = g.clone(), m.clone(), r.clone()
    g2[10], m2[10], r2[10] = -1e37, 0.0, 3.3e38  # p' = p + 1.33e37, finite; the change 1.33e37 + 3.3e38 is not
    assert check(g2, m2, kept.clone(), r2) == kernels.CHANGE_NOT_FINITE
    assert torch.equal(p, kept) and torch.equal(m2[11:], m[11:])


@pytest.mark.parametrize("lengths", [[0], [1], [5, 0, 7], [3 << 20, 1, (1 << 20) + 5]])
def test_a_checksum_in_pieces_on_threads_is_zlib_crc32_of_the_whole(lengths):
    generator = np.random.default_rng(sum(lengths))
    blobs = [generator.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    whole = zlib.crc32(b"".join(blobs))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            pool = KernelThreads()
            assert checksums.crc32([memoryview(b) for b in blobs], pool) == whole
            pool.close()
    finally:
        torch.set_num_threads(before)
    assert checksums.crc32_join(zlib.crc32(b"ab"), zlib.crc32(b"cde"), 3) == zlib.crc32(b"abcde")


@compiled_only
def test_the_compiled_crc32_is_zlibs_at_every_length_and_start():
    generator = np.random.default_rng(0)
    for numel in [*range(0, 200), 4095, 4096, 4097, 65536 + 13]:
        data = generator.integers(0, 256, numel, dtype=np.uint8)
        address = data.__array_interface__["data"][0]
        for start in (0, 0x12345678, 0xFFFFFFFF):
            assert kernels.compiled.crc32(address, numel, start) == zlib.crc32(data, start)
