"""The one model of a link: bandwidth, latency and queueing per direction, on whatever clock the caller has.

Shared by the virtual-time harness (`ddiloco.sim.links`: virtual seconds) and the runtime's link
emulation (`ddiloco.transport.link`: the wall clock, `ddiloco.clock`). Neither the config nor the pipe
reads a clock: every call is given `now` by its caller, so the same arithmetic runs under both.

- `LinkConfig`: one direction's one-way latency and bandwidth (the runtime gives both directions the same).
- `SerialPipe`: messages leave one at a time, first in first out: a message starts when the previous one
  has left (so a burst queues, and peak bandwidth matters), takes its transfer time to leave, then
  arrives after the latency; latencies overlap (a message does not wait for the previous one's
  propagation). The harness's link is exactly this; the runtime's adds a small burst allowance in front
  (a token bucket, as tc's tbf) and uses a pipe for the bandwidth cap of a fault.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from ddiloco.checks import require

BITS_PER_BYTE = 8


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """One direction of a link (the runtime's `--link` gives both directions this)."""

    latency_s: float = 0.01
    """One-way propagation delay, seconds."""
    bandwidth_bps: float = 1e9
    """Bits per second the link carries; math.inf for no limit."""

    def __post_init__(self) -> None:
        require(isinstance(self.latency_s, int | float) and math.isfinite(self.latency_s) and self.latency_s >= 0,
                "latency_s", self.latency_s, "a finite number >= 0 (seconds)")
        require(isinstance(self.bandwidth_bps, int | float) and self.bandwidth_bps > 0, "bandwidth_bps",
                self.bandwidth_bps, "a number > 0 (bits per second; inf: no limit)")

    def transfer_s(self, nbytes: int) -> float:
        """Time to push `nbytes` onto an idle link (without the latency)."""
        return nbytes * BITS_PER_BYTE / self.bandwidth_bps

    def transfer_time_s(self, nbytes: int) -> float:
        """Time for `nbytes` to cross an idle link: serialisation plus latency."""
        return self.transfer_s(nbytes) + self.latency_s


class SerialPipe:
    """First-in-first-out serialisation: `send` books a message and says when its last byte has left.
    Thread-safe (the runtime's sender and receiver threads share a link)."""

    def __init__(self) -> None:
        self._free_at = -math.inf
        self._lock = threading.Lock()

    def send(self, now: float, transfer_s: float) -> float:
        """Book a message taking `transfer_s` to leave, handed over at `now`; returns when it has left."""
        with self._lock:
            self._free_at = max(now, self._free_at) + transfer_s
            return self._free_at

    def reset(self, now: float) -> None:
        """The endpoint died: whatever was queued is gone, the pipe is idle from `now`."""
        with self._lock:
            self._free_at = now
