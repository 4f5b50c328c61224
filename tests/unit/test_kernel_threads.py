"""KernelThreads: range k of every task on thread k, errors raised once every lane is done, helpers stopped."""

from __future__ import annotations

import threading

import pytest
import torch

from ddiloco.kernel_threads import KernelThreads


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_range_k_of_every_task_runs_on_thread_k(three_threads):
    pool = KernelThreads()
    ranges = [(0, 1), (1, 2), (2, 3)]
    try:
        names = pool.run([(lambda a, b: (a, threading.current_thread().name), ranges),
                          (lambda a, b: threading.current_thread().name, ranges[:2])])
    finally:
        pool.close()
    first, second = names
    assert [start for start, _ in first] == [0, 1, 2]
    lanes = [name for _, name in first]
    assert lanes[0] == threading.current_thread().name and len(set(lanes)) == 3
    assert second == lanes[:2]


@pytest.mark.parametrize("failing", [0, 1])  # the calling thread's lane, a helper's
def test_a_lane_that_raises_is_raised_once_the_others_have_finished(three_threads, failing):
    pool = KernelThreads()
    finished = []

    def work(start: int, stop: int) -> int:
        if start == failing:
            raise ValueError(f"lane {failing} failed")
        threading.Event().wait(0.05)
        finished.append(start)
        return start

    try:
        with pytest.raises(ValueError, match=f"lane {failing} failed"):
            pool.run([(work, [(0, 1), (1, 2), (2, 3)])])
        assert sorted(finished) == sorted({0, 1, 2} - {failing})  # no other lane still running when it came out
        assert pool.run([(lambda a, b: a, [(0, 1), (1, 2), (2, 3)])]) == [[0, 1, 2]]  # the helpers still serve
    finally:
        pool.close()


def test_close_stops_the_helper_threads_and_a_later_batch_starts_new_ones(three_threads):
    def helpers() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("ddiloco-kernel-")}

    before = helpers()
    pool = KernelThreads()
    assert pool.run([(lambda a, b: a, [(0, 1), (1, 2)])]) == [[0, 1]]
    assert len(helpers() - before) == 1
    pool.close()
    assert helpers() == before
    assert pool.run([(lambda a, b: a, [(0, 1), (1, 2), (2, 3)])]) == [[0, 1, 2]]
    pool.close()
    assert helpers() == before


def test_two_callers_at_once_each_get_their_own_results(three_threads):
    pool = KernelThreads()
    results: dict[int, list] = {}

    def call(caller: int) -> None:
        results[caller] = [pool.run([(lambda a, b, c=caller: (c, a), [(0, 1), (1, 2), (2, 3)])]) for _ in range(200)]

    callers = [threading.Thread(target=call, args=(c,)) for c in range(3)]
    try:
        for t in callers:
            t.start()
        for t in callers:
            t.join()
    finally:
        pool.close()
    for caller, runs in results.items():
        assert runs == [[[(caller, 0), (caller, 1), (caller, 2)]]] * 200
