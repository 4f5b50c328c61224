"""Interval arithmetic on event timelines: pauses, unions, step functions and their integrals.

The goodput simulator (`ddiloco.plan.goodput`) describes every system as a few timelines (when a
group of chips is paused, how many chips are down, whether the global model advances) and measures
goodput as integrals of their products. Everything is vectorised NumPy over sorted event times,
except `coalesce_pauses`, whose pauses depend on each other and which walks them with `bisect`
(one iteration per pause, about 0.5 us each).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np


def coalesce_pauses(times_s: np.ndarray, durations_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pauses triggered by sorted events; an event that arrives during a pause is absorbed by it.

    A reconfiguration (downscale, upscale, restart) plans with the hardware that is healthy when it
    finishes, so a failure or a return that happens while it runs adds no pause of its own. The next
    pause starts at the first event at or after the end of the current one. Returns (starts, ends).
    """
    if len(times_s) != len(durations_s):
        raise ValueError(f"{len(times_s)} event times but {len(durations_s)} durations")
    times = np.asarray(times_s, dtype=np.float64).tolist()
    durations = np.asarray(durations_s, dtype=np.float64).tolist()
    starts, ends = [], []
    i, count = 0, len(times)
    while i < count:
        end = times[i] + durations[i]
        starts.append(times[i])
        ends.append(end)
        i = bisect_left(times, end, i + 1)
    return np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)


def clip_intervals(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Intervals cut to [lo, hi); empty ones dropped."""
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    keep = e > s
    return s[keep], e[keep]


def total_length(starts: np.ndarray, ends: np.ndarray) -> float:
    return float(np.sum(ends - starts)) if len(starts) else 0.0


class StepFunction:
    """A right-continuous step function: `initial` before the first breakpoint, then cumulative jumps.

    Built from (time, jump) pairs, or from values on breakpoints, or as the indicator of intervals.
    `values_at` and `integral` work on whole arrays, so "chips down while the job runs" needs no
    loop over events.
    """

    def __init__(self, times_s: np.ndarray, jumps: np.ndarray, *, initial: float = 0.0) -> None:
        times_s = np.asarray(times_s, dtype=np.float64)
        order = np.argsort(times_s, kind="stable")
        self.times = times_s[order]
        self.initial = float(initial)
        self.levels = initial + np.cumsum(np.asarray(jumps, dtype=np.float64)[order])
        # cumulative[k] = integral from times[0] to times[k]
        self.cumulative = np.concatenate(([0.0], np.cumsum(self.levels[:-1] * np.diff(self.times))))

    @classmethod
    def indicator(cls, starts: np.ndarray, ends: np.ndarray) -> StepFunction:
        """1 on [start, end) of each interval (overlapping intervals add up)."""
        return cls(np.concatenate([starts, ends]), np.concatenate([np.ones(len(starts)), -np.ones(len(ends))]))

    @classmethod
    def from_values(cls, times_s: np.ndarray, values: np.ndarray, *, initial: float = 0.0) -> StepFunction:
        """The function equal to values[k] on [times[k], times[k + 1]) (times sorted)."""
        values = np.asarray(values, dtype=np.float64)
        jumps = np.diff(values, prepend=initial)
        return cls(times_s, jumps, initial=initial)

    def values_at(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if len(self.times) == 0:
            return np.full_like(x, self.initial)
        k = np.searchsorted(self.times, x, side="right") - 1
        return np.where(k >= 0, self.levels[np.maximum(k, 0)], self.initial)

    def antiderivative(self, x: np.ndarray) -> np.ndarray:
        """Integral from times[0] (or from x itself, before it) to x, plus initial * x before that."""
        x = np.asarray(x, dtype=np.float64)
        if len(self.times) == 0:
            return self.initial * x
        k = np.searchsorted(self.times, x, side="right") - 1
        kk = np.maximum(k, 0)
        after = self.cumulative[kk] + self.levels[kk] * (x - self.times[kk])
        before = self.initial * (x - self.times[0])
        return np.where(k >= 0, after, before)

    def integral(self, starts: np.ndarray, ends: np.ndarray) -> float:
        """Sum over intervals of the integral of the function from start to end."""
        if len(starts) == 0:
            return 0.0
        return float(np.sum(self.antiderivative(ends) - self.antiderivative(starts)))

    def breakpoints(self) -> np.ndarray:
        return self.times


def integrate_product(functions: Sequence[StepFunction], lo: float, hi: float) -> float:
    """Integral over [lo, hi) of the product of step functions, on the union of their breakpoints."""
    points = np.concatenate([f.breakpoints() for f in functions] + [np.array([lo])])
    points = np.unique(points[(points >= lo) & (points < hi)])
    lengths = np.diff(np.append(points, hi))
    product = np.ones(len(points))
    for f in functions:
        product *= f.values_at(points)
    return float(np.sum(product * lengths))


def on_union(functions: Sequence[StepFunction], lo: float, hi: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """The sorted union of breakpoints in [lo, hi) (lo included) and every function's values there."""
    points = np.concatenate([f.breakpoints() for f in functions] + [np.array([lo])])
    points = np.unique(points[(points >= lo) & (points < hi)])
    return points, [f.values_at(points) for f in functions]


def segments(points: np.ndarray, mask: np.ndarray, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """The intervals [points[k], points[k + 1]) (the last one ending at hi) where mask[k] holds."""
    ends = np.append(points[1:], hi)
    return points[mask], ends[mask]
