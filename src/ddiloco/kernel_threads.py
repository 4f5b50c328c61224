"""Where the syncer's kernels run: `KernelThreads` cuts each piece of work of a batch (a tensor's values, a run of
bytes) into ranges, one per thread, and runs range k of every piece on thread k: the calling thread and helper
threads of its own (the compiled kernels and zlib release the GIL; no second OpenMP runtime beside torch's). A
batch returns only once every lane has finished, also when one raised: no thread still writes into its tensors.

How many threads: `torch.get_num_threads()` at each call, the process's setting (`ddiloco syncer --threads`), read as
torch's own operations read it. Handing work to another thread costs 15-50 microseconds here, so callers hand a
whole batch over at once (every tensor of an update, of a close) rather than one tensor at a time. Where the cuts
fall never changes a result: the kernels' sums are cut at chunk boundaries of their stated order (`ddiloco.kernels`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

MIN_SPLIT = 1 << 18
"""A piece is split over threads only in ranges of at least this many elements: below it, handing a range to a thread
costs more than it saves."""

Task = tuple[Callable[[int, int], object], Sequence[tuple[int, int]]]
"""A piece of work and its ranges: `work(start, stop)` for each range."""


class _Helper:
    """A thread that runs one lane of each batch it is handed: `start(work)`, then `join()` for what `work()` returned
    or raised. Two locks hand the batch over: what it costs is the thread's wake-up, not the hand-over (an empty batch
    on two threads, 2026-12-05: 14-15 microseconds after a pause, 45-49 back to back; a `concurrent.futures` pool
    before: 16-22 and 47-48)."""

    def __init__(self, index: int) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._work: Callable[[], list] | None = None
        self._outcome: tuple[list | None, BaseException | None] = (None, None)
        self._thread = threading.Thread(target=self._loop, name=f"ddiloco-kernel-{index}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            work = self._work
            if work is None:
                return
            try:
                self._outcome = (work(), None)
            except BaseException as error:  # handed to the caller, which raises it
                self._outcome = (None, error)
            self._done.release()

    def start(self, work: Callable[[], list]) -> None:
        self._work = work
        self._go.release()

    def join(self) -> tuple[list | None, BaseException | None]:
        self._done.acquire()
        outcome, self._outcome, self._work = self._outcome, (None, None), None
        return outcome

    def stop(self) -> None:
        self._work = None
        self._go.release()
        self._thread.join()


class KernelThreads:
    """Runs a batch of tasks, range k of each on thread k (module docstring). One batch at a time: a second caller
    waits for the first one's batch to finish."""

    def __init__(self, *, max_threads: int | None = None) -> None:
        """`max_threads`: at most this many threads (1: everything on the calling thread, no helper threads)."""
        self.max_threads = max_threads
        self._helpers: list[_Helper] = []
        self._batch = threading.Lock()

    def count(self) -> int:
        threads = max(1, torch.get_num_threads())
        return threads if self.max_threads is None else min(threads, self.max_threads)

    def split(self, count: int, unit: int = 1, *, min_split: int = MIN_SPLIT) -> list[tuple[int, int]]:
        """[0, count) as up to `count()` ranges of whole `unit`s, in units (the last one possibly short), each of at
        least `min_split` elements."""
        units = -(-count // unit)
        if self.max_threads == 1 or units * unit < 2 * min_split:
            return [(0, units)]  # one piece (most tensors of a small model: this is called once per tensor)
        pieces = max(1, min(self.count(), units * unit // min_split))
        step = max(1, -(-units // pieces))
        return [(start, min(start + step, units)) for start in range(0, units, step)] or [(0, 0)]

    def run(self, tasks: Sequence[Task]) -> list[list]:
        """Every task's `work` over each of its ranges, range k of every task on thread k; each task's results in the
        order of its ranges. A lane that raises: the others finish, then the first error (by lane) is raised."""
        lanes = max((len(ranges) for _, ranges in tasks), default=0)

        def lane(k: int) -> list:
            return [work(*ranges[k]) for work, ranges in tasks if k < len(ranges)]

        if lanes <= 1:
            per_lane = [lane(0)] if lanes else []
        else:
            with self._batch:
                while len(self._helpers) < lanes - 1:
                    self._helpers.append(_Helper(len(self._helpers) + 1))
                helpers = self._helpers[:lanes - 1]
                for k, helper in enumerate(helpers, start=1):
                    helper.start(lambda k=k: lane(k))
                try:
                    outcomes = [(lane(0), None)]
                except BaseException as error:
                    outcomes = [(None, error)]
                outcomes += [helper.join() for helper in helpers]
            for _, error in outcomes:
                if error is not None:
                    raise error
            per_lane = [output for output, _ in outcomes]
        results: list[list] = [[] for _ in tasks]
        for k, outputs in enumerate(per_lane):
            owners = [i for i, (_, ranges) in enumerate(tasks) if k < len(ranges)]
            for i, output in zip(owners, outputs, strict=True):
                results[i].append(output)
        return results

    def close(self) -> None:
        """Stops the helper threads (a later batch starts new ones)."""
        with self._batch:
            for helper in self._helpers:
                helper.stop()
            self._helpers = []


INLINE = KernelThreads(max_threads=1)
"""Runs everything on the calling thread (it never makes a pool): for callers that are parallel already (the gRPC
server's threads each check one update) or that pass no threads."""
