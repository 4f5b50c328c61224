"""Where the syncer's kernels run: `KernelThreads` cuts each piece of work of a batch (a tensor's values, a run of
bytes) into ranges, one per thread, and runs range k of every piece on thread k: the calling thread and a small
pool of Python threads (the compiled kernels and zlib release the GIL; no second OpenMP runtime beside torch's).

How many threads: `torch.get_num_threads()` at each call, the process's setting (`ddiloco syncer --threads`), read as
torch's own operations read it. Handing work to another thread costs about 20 microseconds here, so callers hand a
whole batch over at once (every tensor of an update, of a close) rather than one tensor at a time. Where the cuts
fall never changes a result: the kernels' sums are cut at chunk boundaries of their stated order (`ddiloco.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_SPLIT = 1 << 18
"""A piece is split over threads only in ranges of at least this many elements: below it, handing a range to a thread
costs more than it saves."""

Task = tuple[Callable[[int, int], object], Sequence[tuple[int, int]]]
"""A piece of work and its ranges: `work(start, stop)` for each range."""


class KernelThreads:
    """Runs a batch of tasks, range k of each on thread k (module docstring)."""

    def __init__(self, *, max_threads: int | None = None) -> None:
        """`max_threads`: at most this many threads (1: everything on the calling thread, no pool)."""
        self.max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def count(self) -> int:
        threads = max(1, torch.get_num_threads())
        return threads if self.max_threads is None else min(threads, self.max_threads)

    def split(self, count: int, unit: int = 1, *, min_split: int = MIN_SPLIT) -> list[tuple[int, int]]:
        """[0, count) as up to `count()` ranges of whole `unit`s, in units (the last one possibly short), each of at
        least `min_split` elements."""
        units = -(-count // unit)
        pieces = max(1, min(self.count(), units * unit // min_split))
        step = max(1, -(-units // pieces))
        return [(start, min(start + step, units)) for start in range(0, units, step)] or [(0, 0)]

    def run(self, tasks: Sequence[Task]) -> list[list]:
        """Every task's `work` over each of its ranges, range k of every task on thread k; each task's results in the
        order of its ranges."""
        lanes = max((len(ranges) for _, ranges in tasks), default=0)

        def lane(k: int) -> list:
            return [work(*ranges[k]) for work, ranges in tasks if k < len(ranges)]

        if lanes <= 1:
            per_lane = [lane(0)] if lanes else []
        else:
            helpers = lanes - 1
            if self._pool is None or self._pool_size < helpers:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="ddiloco-kernel")
                self._pool_size = helpers
            futures = [self._pool.submit(lane, k) for k in range(1, lanes)]
            per_lane = [lane(0), *(f.result() for f in futures)]
        results: list[list] = [[] for _ in tasks]
        for k, outputs in enumerate(per_lane):
            owners = [i for i, (_, ranges) in enumerate(tasks) if k < len(ranges)]
            for i, output in zip(owners, outputs, strict=True):
                results[i].append(output)
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._pool_size = None, 0


INLINE = KernelThreads(max_threads=1)
"""Runs everything on the calling thread (it never makes a pool): for callers that are parallel already (the gRPC
server's threads each check one update) or that pass no threads."""
