"""Link emulation: per-direction bandwidth and latency, so one machine behaves like distant regions.

A learner's transport shapes its own traffic (no root, no `tc`): every message sent or received is
given a delivery time by an `EmulatedLink`, and the transport hands it over (to the network, or to
the learner's inbox) only then. Each direction is a token bucket (bandwidth, with a small burst
allowance) followed by a fixed one-way latency:

    ready = when the bucket has paid for the message's bytes      (serialisation at the bandwidth)
    deliver = ready + latency                                      (propagation)

Messages queue behind each other in the bucket, as on a real link, while latencies overlap (a
message does not wait for the previous one's propagation). `parse_link("2.5gbit,40ms")` reads the
command-line form. This module owns the arithmetic only; the gRPC client applies it.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass

from ddiloco.clock import Clock, MonotonicClock

BURST_S = 0.001
"""A bucket holds this many seconds of bandwidth (as tc's tbf burst): small messages (heartbeats)
pass at once, while a large message takes (size - burst) / bandwidth, within 1 ms of size / bandwidth."""
MIN_BURST_BYTES = 16 * 1024
"""Lower bound of the burst, so a very slow link still lets a heartbeat through without queueing."""

_BANDWIDTH_UNITS = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
    "b": 8.0, "kb": 8e3, "mb": 8e6, "gb": 8e9, "tb": 8e12,
}
"""Bandwidth units to bits per second: `bit`/`bps` families are bits, `b`/`kb`/... are bytes (as in tc)."""
_LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One direction-symmetric link: both directions get this bandwidth and latency."""

    bandwidth_bps: float
    """Bits per second in each direction; math.inf for no limit."""
    latency_s: float
    """One-way latency in seconds."""

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth_bps={self.bandwidth_bps!r} is invalid: expected a number > 0")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s={self.latency_s!r} is invalid: expected a finite number >= 0")

    def transfer_time_s(self, nbytes: int) -> float:
        """Time for `nbytes` to cross an idle link: serialisation plus latency."""
        return nbytes * 8 / self.bandwidth_bps + self.latency_s


def _parse_quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    match = _QUANTITY.match(text.lower())
    if match is None or match.group(2) not in units:
        raise ValueError(f"{what} {text!r} is invalid: expected a number and one of "
                         f"{', '.join(units)} (e.g. {example})")
    return float(match.group(1)) * units[match.group(2)]


def parse_link(text: str) -> LinkSpec:
    """`BANDWIDTH,LATENCY`, e.g. `2.5gbit,40ms`, `100mbit,5ms`, `1gb,0ms` (gb = gigabytes/s)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"link {text!r} is invalid: expected BANDWIDTH,LATENCY such as 2.5gbit,40ms")
    bandwidth = _parse_quantity(parts[0], _BANDWIDTH_UNITS, "link bandwidth", "2.5gbit")
    latency = _parse_quantity(parts[1], _LATENCY_UNITS, "link latency", "40ms")
    if bandwidth <= 0:
        raise ValueError(f"link bandwidth {parts[0]!r} is invalid: expected more than 0")
    return LinkSpec(bandwidth_bps=bandwidth, latency_s=latency)


class TokenBucket:
    """Bytes per second with a burst allowance. `reserve` books a message and says when it may go.

    Tokens may go negative (debt): a message larger than the bucket departs at once in the sense
    that it is booked, and later messages wait until its debt is paid, which models a message
    occupying the link for nbytes / rate seconds. Thread-safe.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate_bytes_per_s={rate_bytes_per_s!r} is invalid: expected > 0")
        if not burst_bytes >= 0:
            raise ValueError(f"burst_bytes={burst_bytes!r} is invalid: expected >= 0")
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = burst_bytes
        self._tokens = burst_bytes
        self._updated_at: float | None = None
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, now: float) -> float:
        """Book `nbytes` at time `now`; returns the time at which the last byte has left."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} is invalid: expected >= 0")
        if math.isinf(self.rate_bytes_per_s):
            return now
        with self._lock:
            if self._updated_at is not None and now > self._updated_at:
                refill = (now - self._updated_at) * self.rate_bytes_per_s
                self._tokens = min(self.burst_bytes, self._tokens + refill)
            self._updated_at = now if self._updated_at is None else max(now, self._updated_at)
            self._tokens -= nbytes
            if self._tokens >= 0:
                return self._updated_at
            # In debt: the message has fully left once the debt is paid back at the rate.
            return self._updated_at + (-self._tokens) / self.rate_bytes_per_s


class LinkDirection:
    """One direction of a link: a token bucket, then a fixed latency."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        rate = spec.bandwidth_bps / 8
        burst = max(MIN_BURST_BYTES, rate * BURST_S) if math.isfinite(rate) else math.inf
        self.bucket = TokenBucket(rate, burst)

    def deliver_at(self, nbytes: int, now: float) -> float:
        """When a message of `nbytes` handed to the link at `now` reaches the other end."""
        return self.bucket.reserve(nbytes, now) + self.spec.latency_s


class EmulatedLink:
    """Both directions of one learner's link to the syncer (they do not share bandwidth)."""

    def __init__(self, spec: LinkSpec, *, clock: Clock | None = None) -> None:
        self.spec = spec
        self.clock = clock or MonotonicClock()
        self.uplink = LinkDirection(spec)
        self.downlink = LinkDirection(spec)

    def send_at(self, nbytes: int) -> float:
        """When a learner->syncer message of `nbytes` booked now reaches the syncer."""
        return self.uplink.deliver_at(nbytes, self.clock.now())

    def receive_at(self, nbytes: int, arrived_at: float | None = None) -> float:
        """When a syncer->learner message of `nbytes`, read off the socket at `arrived_at`, may be
        handed to the learner."""
        return self.downlink.deliver_at(nbytes, self.clock.now() if arrived_at is None else arrived_at)


def unlimited_link(clock: Clock | None = None) -> EmulatedLink:
    """No shaping: infinite bandwidth, zero latency (the identity link, so callers need no `if`)."""
    return EmulatedLink(LinkSpec(bandwidth_bps=math.inf, latency_s=0.0), clock=clock)
