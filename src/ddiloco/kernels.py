"""The syncer's per-value arithmetic, one pass each: an update's norm (its finite check), adding an update to its
round's sums straight from the int4 codes, and the close's outer Nesterov step fused with the int8 downlink change.

Each function has two paths with the same bits: the compiled kernels of `ddiloco._kernels` (plain C built at
install time, `setup.py`) when the module is there, and eager torch ops otherwise (a machine that had no C
compiler; slower, never different). Both follow the arithmetic stated here, which every result of the syncer
depends on and which therefore names every rounding:

- Norm: ||x||^2 is a float64 sum of the exact float64 squares of the float32 values, in a fixed order: chunks of
  NORM_CHUNK values; in a chunk, LANES running sums (value i of the chunk to lane i % LANES), then the lanes added
  in lane order; then the chunks' totals in chunk order. ||x|| = sqrt of that. It is finite exactly when every value
  is (a float32 squared cannot overflow float64), so it is the check as well.
- Sums: acc = x * a for the first term, then acc = acc + (x * a): a rounded to float32, the product and the sum
  each rounded to float32 (no fused multiply-add, which torch uses on some CPUs and not on others). An int4 value
  is x = float32(code - 8) * scale, as `ddiloco.compression` decodes it.
- Close (`nesterov_int8`): see that function.

Threads: a tensor is cut into ranges that `KernelThreads` runs on `torch.get_num_threads()` threads (the syncer's
`--threads`), the kernels releasing the GIL. Cuts fall on chunk or block boundaries, so the bits do not depend on the
number of threads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ddiloco.compression import Int4Codec, Int4Config

try:
    from ddiloco import _kernels as compiled
except ImportError:  # built without a C compiler: the eager path (same bits, slower)
    compiled = None

NORM_CHUNK = 65536
"""Values per chunk of a sum of squares (see the module docstring); as `_kernels.c` defines it."""
LANES = 16
"""Running sums per chunk."""
MIN_SPLIT_VALUES = 1 << 18
"""A tensor is split over threads only in ranges of at least this many values: below it, handing a range to a thread
costs more than it saves."""

if compiled is not None:
    assert (compiled.NORM_CHUNK, compiled.LANES) == (NORM_CHUNK, LANES), "rebuild ddiloco._kernels (setup.py)"


class KernelThreads:
    """Runs a kernel over ranges of its tensors on `torch.get_num_threads()` threads, read at each call as torch's own
    operations read it: the calling thread runs the first range, a pool the rest."""

    def __init__(self, *, max_threads: int | None = None) -> None:
        """`max_threads`: at most this many threads (1: every range on the calling thread, no pool)."""
        self.max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def count(self) -> int:
        threads = max(1, torch.get_num_threads())
        return threads if self.max_threads is None else min(threads, self.max_threads)

    def run(self, work: Callable[[int, int], object], ranges: Sequence[tuple[int, int]]) -> list:
        """`work(start, stop)` for each range, in parallel; the results in the order of `ranges`."""
        if len(ranges) <= 1:
            return [work(*r) for r in ranges]
        helpers = len(ranges) - 1
        if self._pool is None or self._pool_size < helpers:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool, self._pool_size = ThreadPoolExecutor(helpers, thread_name_prefix="ddiloco-kernel"), helpers
        futures = [self._pool.submit(work, *r) for r in ranges[1:]]
        first = work(*ranges[0])
        return [first, *(f.result() for f in futures)]

    def split(self, count: int, unit: int) -> list[tuple[int, int]]:
        """[0, count) in up to `count()` ranges of whole `unit`s (the last one possibly short), each of at least
        MIN_SPLIT_VALUES / unit units."""
        units = -(-count // unit)
        pieces = max(1, min(self.count(), units * unit // MIN_SPLIT_VALUES))
        step = -(-units // pieces)
        return [(start, min(start + step, units)) for start in range(0, units, step)] or [(0, 0)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._pool_size = None, 0


INLINE = KernelThreads(max_threads=1)
"""Runs every range on the calling thread (it never makes a pool): for callers that are parallel already (the gRPC
server's threads each decode one update) or that pass no threads."""


@dataclasses.dataclass(frozen=True)
class Int4Blocks:
    """An int4 payload read where it lies (`ddiloco.compression`'s layout): `numel` values in blocks of `block_size`,
    the float32 scales then the packed codes. Its values are decoded only while they are added to a round's sums."""

    payload: bytes
    numel: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return -(-self.numel // self.block_size)

    def addresses(self) -> tuple[int, int]:
        """(address of the scales, address of the codes); valid while `payload` lives (it is immutable)."""
        base = np.frombuffer(self.payload, dtype=np.uint8).__array_interface__["data"][0]
        return base, base + 4 * self.num_blocks

    def decode(self) -> torch.Tensor:
        """The float32 values, as `Int4Codec.decode` gives them."""
        return Int4Codec(Int4Config(block_size=self.block_size)).decode(self.payload, (self.numel,))


def _flat(values: torch.Tensor, *, writable: bool = False) -> torch.Tensor:
    """`values` as a flat contiguous float32 CPU tensor (a copy only where they are not contiguous; never for a sum
    written in place, `writable`)."""
    if values.dtype != torch.float32 or values.device.type != "cpu" or (writable and not values.is_contiguous()):
        raise ValueError(f"expected a contiguous float32 CPU tensor, got {values.dtype} on {values.device}")
    return values.contiguous().view(-1)


def _sequential_sum(totals: Sequence[float]) -> float:
    total = 0.0
    for t in totals:  # in order (builtin sum() compensates on newer Pythons: another rounding)
        total += t
    return total


def square_sum(values: torch.Tensor | Int4Blocks, threads: KernelThreads = INLINE) -> float:
    """||values||^2 in the stated order (module docstring): inf or NaN when a value is not finite."""
    if compiled is None:
        return _eager_square_sum(_flat(values.decode() if isinstance(values, Int4Blocks) else values))
    if isinstance(values, Int4Blocks):
        numel, (scales, codes) = values.numel, values.addresses()

        def chunk_sums(c0: int, c1: int) -> None:
            compiled.square_sums_int4(scales, codes, numel, values.block_size, c0, c1, totals[c0:].data_ptr())
    else:
        x = _flat(values)
        numel = x.numel()

        def chunk_sums(c0: int, c1: int) -> None:
            compiled.square_sums_f32(x.data_ptr(), numel, c0, c1, totals[c0:].data_ptr())
    if numel == 0:
        return 0.0
    totals = torch.empty(-(-numel // NORM_CHUNK), dtype=torch.float64)  # one per chunk
    threads.run(chunk_sums, threads.split(numel, NORM_CHUNK))
    return _sequential_sum(totals.tolist())


def _eager_square_sum(x: torch.Tensor) -> float:
    numel = x.numel()
    if numel == 0:
        return 0.0
    chunks = -(-numel // NORM_CHUNK)
    squares = torch.zeros(chunks * NORM_CHUNK, dtype=torch.float64)
    squares[:numel] = x
    squares.square_()  # exact: 24-bit significands squared fit float64's 53
    # cumsum runs each lane's sum in order, from the lane's first value (0 + s = s for the first, as the kernel starts).
    lanes = squares.view(chunks, NORM_CHUNK // LANES, LANES).cumsum(dim=1)[:, -1, :]
    totals = lanes[:, 0].clone()
    for j in range(1, LANES):
        totals += lanes[:, j]
    return _sequential_sum(totals.tolist())


def l2_norm(values: torch.Tensor | Int4Blocks, threads: KernelThreads = INLINE) -> float:
    """||values||_2 as a Python float, in the stated order; inf or NaN when a value is not finite."""
    return math.sqrt(square_sum(values, threads))


def accumulate(acc: torch.Tensor, values: torch.Tensor | Int4Blocks, alpha: float, *, first: bool,
               threads: KernelThreads = INLINE) -> None:
    """acc = values * alpha (`first`) or acc + values * alpha, in place, as the module docstring rounds it."""
    flat = _flat(acc, writable=True)
    numel = flat.numel()
    if (values.numel if isinstance(values, Int4Blocks) else values.numel()) != numel:
        raise ValueError(f"values of another size than the sum's {numel}")
    if compiled is None:
        x = _flat(values.decode() if isinstance(values, Int4Blocks) else values)
        if first:
            torch.mul(x, alpha, out=flat)  # alpha rounded to float32, as torch rounds a scalar for a float32 tensor
        else:
            flat.add_(torch.mul(x, alpha))  # two roundings: never add_(x, alpha=...), which fuses on AVX2 CPUs
        return
    if isinstance(values, Int4Blocks):
        scales, codes = values.addresses()

        def add_range(u0: int, u1: int) -> None:
            compiled.accumulate_int4(flat.data_ptr(), scales, codes, values.block_size, u0 * NORM_CHUNK,
                                     min(u1 * NORM_CHUNK, numel), alpha, first)
    else:
        x = _flat(values)

        def add_range(u0: int, u1: int) -> None:
            compiled.accumulate_f32(flat.data_ptr(), x.data_ptr(), u0 * NORM_CHUNK, min(u1 * NORM_CHUNK, numel), alpha,
                                    first)
    threads.run(add_range, threads.split(numel, NORM_CHUNK))


@dataclasses.dataclass(frozen=True)
class CloseResult:
    """What `nesterov_int8` found: `flags` (checking: STEP_NOT_FINITE | CHANGE_NOT_FINITE; writing: CHANGE_NOT_FINITE
    when a change was not finite) and, having written, the largest |m|, |p| and |r| it wrote."""

    flags: int
    momentum_max: float = 0.0
    param_max: float = 0.0
    residual_max: float = 0.0


STEP_NOT_FINITE = 1
"""A new momentum or parameter is not finite (the round must not commit)."""
CHANGE_NOT_FINITE = 2
"""A downlink change is not finite (the downlink sends the exact value instead)."""


def nesterov_int8(merged: torch.Tensor, momentum: torch.Tensor | None, param: torch.Tensor, residual: torch.Tensor, *,
                  lr: float, mu: float, first_step: bool, block_size: int, out: np.ndarray | None,
                  threads: KernelThreads = INLINE) -> CloseResult:
    """One tensor's close in one pass per value, with the compiled kernels only (the eager path is the outer optimizer
    then the downlink rule, `ddiloco.fused_close`): with g = `merged`, m = `momentum`, p = `param`, r = `residual`,
    every operation rounded on its own in float32,

        m' = g (`first_step`: `momentum` is only written) or m * mu + g;   u = g + m' * mu   (u = g when mu = 0;
                                   `momentum` is then not used)
        p' = p - u * lr            the outer step (`ddiloco.outer`)
        c  = (p' - p) + r          the downlink change (`ddiloco.downlink`), cut in blocks of `block_size`
        s  = max |c| / 127 per block; q = round-half-even(c / s) within -127..127 (c / 1 for s = 0)
        p  = p + (q + 0) * s;  r = c - (q + 0) * s      what every learner rebuilds, and the error kept

    `out`: the int8 payload to write (the blocks' float32 scales, then the codes q + 128), or None to check only
    (nothing written). Writing after a check that found nothing leaves every value consistent; a change that is not
    finite stops the writing at its block."""
    if compiled is None:
        raise RuntimeError("ddiloco._kernels is not built: use the outer optimizer and the downlink rule")
    g, p, r = _flat(merged), _flat(param, writable=True), _flat(residual, writable=True)
    m = None if momentum is None else _flat(momentum, writable=True)
    if m is None and mu != 0:
        raise ValueError("a step with momentum needs its momentum tensor (to write, at the first step)")
    numel = g.numel()
    num_blocks = -(-numel // block_size)
    if out is not None and out.nbytes != 4 * num_blocks + numel:
        raise ValueError(f"an int8 payload of {numel} values is {4 * num_blocks + numel} bytes, got {out.nbytes}")
    base = 0 if out is None else out.__array_interface__["data"][0]
    m_address = 0 if m is None else m.data_ptr()
    blocks_per_unit = max(1, NORM_CHUNK // block_size)
    ranges = [(u0 * blocks_per_unit, min(u1 * blocks_per_unit, num_blocks))
              for u0, u1 in threads.split(numel, blocks_per_unit * block_size)]
    maxima = torch.zeros(len(ranges), 3)  # per range: |m|, |p|, |r| written

    def run(b0: int, b1: int) -> int:
        slot = maxima[ranges.index((b0, b1))]
        return compiled.nesterov_int8(g.data_ptr(), m_address, p.data_ptr(), r.data_ptr(), base, base + 4 * num_blocks,
                                      numel, block_size, lr, mu, first_step, out is None, b0, b1, slot.data_ptr())

    results = threads.run(run, ranges)
    if out is None:
        flags = 0
        for result in results:
            flags |= result
        return CloseResult(flags)
    momentum_max, param_max, residual_max = maxima.amax(dim=0).tolist()
    return CloseResult(CHANGE_NOT_FINITE if any(result >= 0 for result in results) else 0, momentum_max, param_max,
                       residual_max)
