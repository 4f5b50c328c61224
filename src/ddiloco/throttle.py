"""Which of many similar events to report one by one (sans-I/O: the caller passes the time in).

Per key, the first event of a period is reported in full; the others of that period are only counted, and `drain`
hands back those counts once the period is over, for one summary per key. The keys held at once are bounded: past
`max_keys`, new keys share `overflow_key`. The syncer service throttles its log lines and events for refused calls
this way (docs/runtime.md), since anyone who can reach its port can make them as fast as they can call.
"""

from __future__ import annotations

from collections.abc import Hashable


class Throttle:
    """At most one event in full per key and period; the rest counted for `drain`."""

    def __init__(self, period_s: float, *, max_keys: int, overflow_key: Hashable) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s={period_s} is invalid: expected > 0 (seconds)")
        if max_keys < 1:
            raise ValueError(f"max_keys={max_keys} is invalid: expected >= 1")
        self.period_s = period_s
        self.max_keys = max_keys
        self.overflow_key = overflow_key
        self._suppressed: dict[Hashable, int] = {}
        """key -> events counted but not reported in the current period (0: only its first, reported)."""
        self._period_start: float | None = None

    def admit(self, key: Hashable, now: float) -> bool:
        """True: report this event in full. False: it was counted for the period's summary."""
        if self._period_start is None:
            self._period_start = now
        if key not in self._suppressed and len(self._suppressed) >= self.max_keys:
            key = self.overflow_key
        if key in self._suppressed:
            self._suppressed[key] += 1
            return False
        self._suppressed[key] = 0
        return True

    def drain(self, now: float, *, final: bool = False) -> dict[Hashable, int]:
        """Once the period is over (or at once, when `final`): the events counted per key since it began, for keys
        that had any; a new period begins with the next event."""
        if self._period_start is None or (not final and now < self._period_start + self.period_s):
            return {}
        counted = {key: count for key, count in self._suppressed.items() if count}
        self._suppressed.clear()
        self._period_start = None
        return counted
