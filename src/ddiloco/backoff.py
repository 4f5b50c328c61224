"""Exponential backoff with a cap, one rule for every retry: a learner reaching its syncer, a supervisor
restarting a child."""

from __future__ import annotations

from ddiloco.checks import require, require_positive


class Backoff:
    """Delays initial_s, factor x initial_s, ... up to max_s; `reset` starts again at initial_s. With
    `stable_after_s`, `after_run` resets by itself once the thing retried ran that long (a child that stayed up
    a while and then died is restarted quickly again, not after the longest delay)."""

    def __init__(self, initial_s: float, max_s: float, *, factor: float = 2.0,
                 stable_after_s: float = float("inf")) -> None:
        require_positive("initial_s", initial_s, "seconds")
        require(max_s >= initial_s, "max_s", max_s, f"seconds >= initial_s ({initial_s})")
        require(factor >= 1, "factor", factor, "a number >= 1")
        require(stable_after_s >= 0, "stable_after_s", stable_after_s, "seconds >= 0")
        self.initial_s, self.max_s, self.factor, self.stable_after_s = initial_s, max_s, factor, stable_after_s
        self._next_s = initial_s

    def next_delay(self) -> float:
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * self.factor)
        return delay

    def reset(self) -> None:
        self._next_s = self.initial_s

    def after_run(self, ran_for_s: float) -> float:
        """The delay before retrying something that ran `ran_for_s` seconds before it failed."""
        if ran_for_s >= self.stable_after_s:
            self.reset()
        return self.next_delay()
