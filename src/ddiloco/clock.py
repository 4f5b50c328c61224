"""Clocks for drivers. The learner and syncer cores never read a clock: drivers pass `now` in.

`MonotonicClock` is wall time for the real runtime; `VirtualClock` is the discrete-event time of the
simulator, moved only by its owner, so runs are deterministic.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """Seconds from `time.monotonic()`."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Simulated seconds; only `advance_to` moves it, and never backwards."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance_to(self, time_s: float) -> None:
        if time_s < self._now:
            raise ValueError(f"virtual time cannot go back from {self._now} to {time_s}")
        self._now = time_s
