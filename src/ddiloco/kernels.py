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

Threads: each function takes a batch (every tensor of an update, of a close) and `ddiloco.kernel_threads` runs it,
each tensor cut at chunk or block boundaries into one range per thread, so the bits do not depend on the number of
threads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from ddiloco.compression import Int4Codec, Int4Config
from ddiloco.kernel_threads import INLINE, KernelThreads, Task

try:
    from ddiloco import _kernels as compiled
except ImportError:  # built without a C compiler: the eager path (same bits, slower)
    compiled = None

NORM_CHUNK = 65536
"""Values per chunk of a sum of squares (see the module docstring); as `_kernels.c` defines it."""
LANES = 16
"""Running sums per chunk."""
if compiled is not None:
    assert (compiled.NORM_CHUNK, compiled.LANES) == (NORM_CHUNK, LANES), "rebuild ddiloco._kernels (setup.py)"


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
        layout = "contiguous" if values.is_contiguous() else f"strided {tuple(values.stride())}"
        raise ValueError(f"expected a contiguous float32 CPU tensor, got a {layout} {values.dtype} tensor on "
                         f"{values.device}")
    return values.contiguous().view(-1)


def _sequential_sum(totals: Sequence[float]) -> float:
    total = 0.0
    for t in totals:  # in order (builtin sum() compensates on newer Pythons: another rounding)
        total += t
    return total


def square_sums(batch: Sequence[torch.Tensor | Int4Blocks], threads: KernelThreads = INLINE) -> list[float]:
    """||values||^2 of each tensor of `batch`, in the stated order (module docstring): inf or NaN where a value is not
    finite."""
    if compiled is None:
        return [_eager_square_sum(_flat(v.decode() if isinstance(v, Int4Blocks) else v)) for v in batch]
    tasks, totals = [], []
    for values in batch:
        numel = values.numel if isinstance(values, Int4Blocks) else values.numel()
        chunk_totals = torch.zeros(max(1, -(-numel // NORM_CHUNK)), dtype=torch.float64)  # one per chunk
        totals.append(chunk_totals)
        if numel:
            tasks.append((_chunk_sums(values, numel, chunk_totals), threads.split(numel, NORM_CHUNK)))
    threads.run(tasks)
    return [_sequential_sum(t.tolist()) for t in totals]


def _chunk_sums(values: torch.Tensor | Int4Blocks, numel: int, out: torch.Tensor):
    """work(c0, c1): the sums of squares of chunks [c0, c1) of `values` into out[c0:c1]."""
    if isinstance(values, Int4Blocks):
        scales, codes = values.addresses()
        return lambda c0, c1: compiled.square_sums_int4(scales, codes, numel, values.block_size, c0, c1,
                                                        out[c0:].data_ptr())
    x = _flat(values)
    return lambda c0, c1: compiled.square_sums_f32(x.data_ptr(), numel, c0, c1, out[c0:].data_ptr())


def square_sum(values: torch.Tensor | Int4Blocks, threads: KernelThreads = INLINE) -> float:
    """||values||^2 in the stated order: `square_sums` of one tensor."""
    return square_sums([values], threads)[0]


def _eager_square_sum(x: torch.Tensor) -> float:
    numel = x.numel()
    if numel == 0:
        return 0.0
    chunks = -(-numel // NORM_CHUNK)
    squares = np.zeros(chunks * NORM_CHUNK)
    squares[:numel] = x.numpy()
    squares *= squares  # exact: 24-bit significands squared fit float64's 53
    # numpy reduces the middle axis row after row, adding each row of LANES into the running lane sums: each lane's
    # sum in order, the kernels' order (tests/unit/test_kernels.py holds it to np.cumsum's, in order by definition).
    lanes = np.add.reduce(squares.reshape(chunks, NORM_CHUNK // LANES, LANES), axis=1)
    return _sequential_sum([_sequential_sum(row) for row in lanes.tolist()])


def l2_norms(batch: Sequence[torch.Tensor | Int4Blocks], threads: KernelThreads = INLINE) -> list[float]:
    """||values||_2 of each tensor of `batch`, in the stated order; inf or NaN where a value is not finite."""
    return [math.sqrt(total) for total in square_sums(batch, threads)]


def l2_norm(values: torch.Tensor | Int4Blocks, threads: KernelThreads = INLINE) -> float:
    """||values||_2 as a Python float, in the stated order; inf or NaN when a value is not finite."""
    return l2_norms([values], threads)[0]


Term = tuple[torch.Tensor, torch.Tensor | Int4Blocks, float, bool]
"""(acc, values, alpha, first) of `accumulate_all`."""


def accumulate_all(terms: Sequence[Term], threads: KernelThreads = INLINE) -> None:
    """For each (acc, values, alpha, first): acc = values * alpha (`first`) or acc + values * alpha, in place, as the
    module docstring rounds it."""
    tasks: list[Task] = []
    for acc, values, alpha, first in terms:
        flat = _flat(acc, writable=True)
        numel = flat.numel()
        if (values.numel if isinstance(values, Int4Blocks) else values.numel()) != numel:
            raise ValueError(f"values of another size than the sum's {numel}")
        if compiled is None:
            x = _flat(values.decode() if isinstance(values, Int4Blocks) else values)
            if first:
                torch.mul(x, alpha, out=flat)  # alpha rounded to float32, as torch rounds a scalar for float32 values
            else:
                flat.add_(torch.mul(x, alpha))  # two roundings: never add_(x, alpha=...), which fuses on AVX2 CPUs
            continue
        tasks.append((_add_ranges(flat, values, alpha, first), threads.split(numel, NORM_CHUNK)))
    threads.run(tasks)


def _add_ranges(flat: torch.Tensor, values: torch.Tensor | Int4Blocks, alpha: float, first: bool):
    """work(u0, u1): the term added to chunks [u0, u1) of the sum `flat`."""
    numel = flat.numel()
    if isinstance(values, Int4Blocks):
        scales, codes = values.addresses()
        return lambda u0, u1: compiled.accumulate_int4(flat.data_ptr(), scales, codes, values.block_size,
                                                       u0 * NORM_CHUNK, min(u1 * NORM_CHUNK, numel), alpha, first)
    x = _flat(values)
    return lambda u0, u1: compiled.accumulate_f32(flat.data_ptr(), x.data_ptr(), u0 * NORM_CHUNK,
                                                  min(u1 * NORM_CHUNK, numel), alpha, first)


def accumulate(acc: torch.Tensor, values: torch.Tensor | Int4Blocks, alpha: float, *, first: bool,
               threads: KernelThreads = INLINE) -> None:
    """`accumulate_all` of one term."""
    accumulate_all([(acc, values, alpha, first)], threads)


def scale_all(items: Sequence[tuple[torch.Tensor, float, bool]], threads: KernelThreads = INLINE) -> None:
    """For each (x, factor, divide): x = x / factor (`divide`) or x * factor, in place, factor rounded to float32 and
    one rounding per value, as torch's `div_` and `mul_` by a Python float give (the merge's last step)."""
    tasks: list[Task] = []
    for x, factor, divide in items:
        flat = _flat(x, writable=True)
        if compiled is None:
            flat.div_(factor) if divide else flat.mul_(factor)
            continue
        numel = flat.numel()
        tasks.append((lambda u0, u1, flat=flat, numel=numel, factor=factor, divide=divide: compiled.scale_f32(
            flat.data_ptr(), u0 * NORM_CHUNK, min(u1 * NORM_CHUNK, numel), factor, divide),
            threads.split(numel, NORM_CHUNK)))
    threads.run(tasks)


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


@dataclasses.dataclass(frozen=True)
class CloseTensor:
    """One tensor of a close (`nesterov_int8`): g, m, p, r; whether it is the tensor's first step; the payload to
    write (None: check only, writing nothing)."""

    merged: torch.Tensor
    momentum: torch.Tensor | None
    """Written at a first step; not used with momentum 0."""
    param: torch.Tensor
    residual: torch.Tensor
    first_step: bool
    out: np.ndarray | None


def nesterov_int8(batch: Sequence[CloseTensor], *, lr: float, mu: float, block_size: int,
                  threads: KernelThreads = INLINE) -> list[CloseResult]:
    """The close of each tensor of `batch` in one pass per value, with the compiled kernels only (the eager path is the
    outer optimizer then the downlink rule, `ddiloco.fused_close`): with g = merged, m = momentum, p = param,
    r = residual, every operation rounded on its own in float32,

        m' = g (first step: m is only written) or m * mu + g;   u = g + m' * mu   (u = g when mu = 0)
        p' = p - u * lr            the outer step (`ddiloco.outer`)
        c  = (p' - p) + r          the downlink change (`ddiloco.downlink`), cut in blocks of `block_size`
        s  = max |c| / 127 per block; q = round-half-even(c / s) within -127..127 (c / 1 for s = 0)
        p  = p + (q + 0) * s;  r = c - (q + 0) * s      what every learner rebuilds, and the error kept

    `out`: the int8 payload to write (the blocks' float32 scales, then the codes q + 128). Writing after a check that
    found nothing leaves every value consistent; a change that is not finite stops the writing at its block."""
    if compiled is None:
        raise RuntimeError("ddiloco._kernels is not built: use the outer optimizer and the downlink rule")
    tasks: list[Task] = []
    maxima = torch.zeros(len(batch), threads.count(), 3)  # per tensor and range: the largest |m|, |p|, |r| written
    per_unit = max(1, NORM_CHUNK // block_size)  # blocks per chunk: ranges of whole chunks, as the sums' are
    for tensor, rows in zip(batch, maxima, strict=True):
        numel = tensor.merged.numel()
        num_blocks = -(-numel // block_size)
        ranges = [(u0 * per_unit, min(u1 * per_unit, num_blocks))
                  for u0, u1 in threads.split(numel, per_unit * block_size)]
        row_of = {b0: rows[k] for k, (b0, _) in enumerate(ranges)}
        tasks.append((_close_blocks(tensor, lr=lr, mu=mu, block_size=block_size, row_of=row_of), ranges))
    results = []
    for tensor, outcomes, written in zip(batch, threads.run(tasks), maxima, strict=True):
        if tensor.out is None:
            flags = 0
            for outcome in outcomes:
                flags |= outcome
            results.append(CloseResult(flags))
        else:
            failed = CHANGE_NOT_FINITE if any(outcome >= 0 for outcome in outcomes) else 0
            results.append(CloseResult(failed, *written.amax(dim=0).tolist()))
    return results


def _close_blocks(tensor: CloseTensor, *, lr: float, mu: float, block_size: int, row_of: dict[int, torch.Tensor]):
    """work(b0, b1): the kernel over blocks [b0, b1) of `tensor`, the largest values it writes into `row_of[b0]`."""
    g, p, r = _flat(tensor.merged), _flat(tensor.param, writable=True), _flat(tensor.residual, writable=True)
    m = None if tensor.momentum is None else _flat(tensor.momentum, writable=True)
    if m is None and mu != 0:
        raise ValueError("a step with momentum needs its momentum tensor (to write, at the first step)")
    numel = g.numel()
    num_blocks = -(-numel // block_size)
    out = tensor.out
    if out is not None and out.nbytes != 4 * num_blocks + numel:
        raise ValueError(f"an int8 payload of {numel} values is {4 * num_blocks + numel} bytes, got {out.nbytes}")
    base = 0 if out is None else out.__array_interface__["data"][0]
    m_address = 0 if m is None else m.data_ptr()
    return lambda b0, b1: compiled.nesterov_int8(g.data_ptr(), m_address, p.data_ptr(), r.data_ptr(), base,
                                                 base + 4 * num_blocks, numel, block_size, lr, mu, tensor.first_step,
                                                 out is None, b0, b1, row_of[b0].data_ptr())
