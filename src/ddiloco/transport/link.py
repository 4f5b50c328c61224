"""Link emulation: per-direction bandwidth and latency, so one machine behaves like distant regions.

A learner's transport shapes its own traffic (no root, no `tc`): every message sent or received is
given a delivery time by an `EmulatedLink`, and the transport hands it over (to the network, or to
the learner's inbox) only then. Each direction is a token bucket (bandwidth, with a small burst
allowance) followed by a fixed one-way latency:

    ready = when the bucket has paid for the message's bytes      (serialisation at the bandwidth)
    deliver = ready + latency                                      (propagation)

Messages queue behind each other in the bucket, as on a real link, while latencies overlap (a
message does not wait for the previous one's propagation). `parse_link("2.5gbit,40ms")` reads the
command-line form, and `check_link` refuses a link on which a learner could never stay in its run (a latency
past the heartbeat timeout) and warns of one that takes minutes to bring it the model. The link's config and
its first-in-first-out queueing are `ddiloco.link_model`'s, shared with the virtual-time harness; this module
adds the burst allowance, the faults and the clock, and the gRPC client applies it.

Faults switched on while a process runs (a chaos run's control file, `ddiloco.fault_control`) reach
the link through a `LinkFaults` object, queried per message: extra latency is added to the one-way
delay, and a bandwidth cap serialises each direction at the capped rate on top of the bucket above:

    capped = max(now, end of the previous capped message) + nbytes / cap
    deliver = max(ready, capped) + latency + extra latency

The same object tells the client about partitions and which messages to drop or corrupt. `NO_FAULTS`
is the identity: a learner without a control file never reads one.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Protocol

from ddiloco.checks import invalid
from ddiloco.clock import Clock, MonotonicClock
from ddiloco.link_model import BITS_PER_BYTE, LinkConfig, SerialPipe

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


def _parse_quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    match = _QUANTITY.match(text.lower())
    if match is None or match.group(2) not in units:
        raise ValueError(f"{what} {text!r} is invalid: expected a number and one of "
                         f"{', '.join(units)} (e.g. {example})")
    value = float(match.group(1)) * units[match.group(2)]
    if not math.isfinite(value):  # 1e400mbit: an infinite bandwidth or latency is no link to emulate
        raise ValueError(f"{what} {text!r} is invalid: expected a finite number and one of {', '.join(units)} "
                         f"(e.g. {example})")
    return value


def parse_link(text: str) -> LinkConfig:
    """`BANDWIDTH,LATENCY`, e.g. `2.5gbit,40ms`, `100mbit,5ms`, `1gb,0ms` (gb = gigabytes/s)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"link {text!r} is invalid: expected BANDWIDTH,LATENCY such as 2.5gbit,40ms")
    bandwidth = _parse_quantity(parts[0], _BANDWIDTH_UNITS, "link bandwidth", "2.5gbit")
    latency = _parse_quantity(parts[1], _LATENCY_UNITS, "link latency", "40ms")
    if bandwidth <= 0:
        raise ValueError(f"link bandwidth {parts[0]!r} is invalid: expected more than 0")
    return LinkConfig(bandwidth_bps=bandwidth, latency_s=latency)


WELCOME_WARN_S = 60.0
"""A link that takes longer than this to bring a learner the global model (its Welcome) gets a warning at the
learner's start: the learner stays `joining` all that time, and nothing else would say why."""


def welcome_s(link: LinkConfig, model_bytes: int) -> float:
    """Seconds `link` takes to bring a Welcome of `model_bytes` (the whole model as float32): its transfer at the
    bandwidth, then the one-way latency."""
    return link.transfer_time_s(model_bytes)


def check_link(link: LinkConfig, *, heartbeat_timeout_s: float | None = None,
               model_bytes: int | None = None) -> str | None:
    """A learner's `--link` against its run, at the learner's start (and the launcher's, before it starts any).

    Raises ValueError when the one-way latency is at least `heartbeat_timeout_s` (the run's
    `quorum.heartbeat_timeout_s`): every message of the learner would reach the syncer after the syncer had
    timed it out, so it would be dropped and re-join for ever, and the run make no round. Returns a warning line
    when the Welcome of a model of `model_bytes` (float32) takes more than `WELCOME_WARN_S` over the link, else
    None. Either check is skipped when its argument is None."""
    if heartbeat_timeout_s is not None and link.latency_s >= heartbeat_timeout_s:
        raise ValueError(f"link latency {_duration(link.latency_s)} is invalid: it must be below the run's heartbeat "
                         f"timeout ({_duration(heartbeat_timeout_s)}), else the syncer drops the learner before its "
                         "messages arrive and the run makes no round; use a shorter latency, or a longer "
                         "--heartbeat-timeout-s")
    if model_bytes is not None and (seconds := welcome_s(link, model_bytes)) > WELCOME_WARN_S:
        return (f"the link ({_rate(link.bandwidth_bps)}, {_duration(link.latency_s)} one way) takes about "
                f"{_duration(seconds)} to bring the global model ({model_bytes / 1e6:.3g} MB as float32, the Welcome), "
                "at the start and at every re-join: the learner stays `joining` until it has arrived")
    return None


def _rate(bandwidth_bps: float) -> str:
    for unit, scale in (("gbit/s", 1e9), ("mbit/s", 1e6), ("kbit/s", 1e3)):
        if bandwidth_bps >= scale:
            return f"{bandwidth_bps / scale:.3g} {unit}"
    return f"{bandwidth_bps:.3g} bit/s"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class LinkFaults(Protocol):
    """Faults active on a learner's link right now; every method is cheap and thread-safe.
    `ddiloco.fault_control.ChaosControl` is one (this layer does not import it)."""

    def partitioned(self) -> bool: ...

    def extra_latency_s(self) -> float: ...

    def bandwidth_bytes_per_s(self) -> float | None: ...

    def should_drop(self) -> bool: ...

    def should_corrupt(self) -> bool: ...


class NoFaults:
    """The identity `LinkFaults`: nothing is ever active (and no file is ever read)."""

    def partitioned(self) -> bool:
        return False

    def extra_latency_s(self) -> float:
        return 0.0

    def bandwidth_bytes_per_s(self) -> float | None:
        return None

    def should_drop(self) -> bool:
        return False

    def should_corrupt(self) -> bool:
        return False


NO_FAULTS = NoFaults()


class TokenBucket:
    """Bytes per second with a burst allowance. `reserve` books a message and says when it may go.

    Tokens may go negative (debt): a message larger than the bucket departs at once in the sense
    that it is booked, and later messages wait until its debt is paid, which models a message
    occupying the link for nbytes / rate seconds. Thread-safe.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float) -> None:
        if not rate_bytes_per_s > 0:
            raise invalid("rate_bytes_per_s", rate_bytes_per_s, "> 0")
        if not burst_bytes >= 0:
            raise invalid("burst_bytes", burst_bytes, ">= 0")
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
    """One direction of a link: a token bucket, then a fixed latency; and, while a fault says so, a
    bandwidth cap and extra latency (see the module docstring)."""

    def __init__(self, spec: LinkConfig) -> None:
        self.spec = spec
        rate = spec.bandwidth_bps / BITS_PER_BYTE
        burst = max(MIN_BURST_BYTES, rate * BURST_S) if math.isfinite(rate) else math.inf
        self.bucket = TokenBucket(rate, burst)
        self._capped = SerialPipe()

    def deliver_at(self, nbytes: int, now: float, *, cap_bytes_per_s: float | None = None,
                   extra_latency_s: float = 0.0) -> float:
        """When a message of `nbytes` handed to the link at `now` reaches the other end."""
        ready = self.bucket.reserve(nbytes, now)
        if cap_bytes_per_s is not None:
            if not cap_bytes_per_s > 0:
                raise invalid("cap_bytes_per_s", cap_bytes_per_s, "> 0")
            # No burst allowance: under a cap every byte pays, so n bytes take n / cap seconds.
            ready = max(ready, self._capped.send(now, nbytes / cap_bytes_per_s))
        return ready + self.spec.latency_s + extra_latency_s


class EmulatedLink:
    """Both directions of one learner's link to the syncer (they do not share bandwidth), and the
    faults active on it."""

    def __init__(self, spec: LinkConfig, *, clock: Clock | None = None, faults: LinkFaults = NO_FAULTS) -> None:
        self.spec = spec
        self.clock = clock or MonotonicClock()
        self.faults = faults
        self.uplink = LinkDirection(spec)
        self.downlink = LinkDirection(spec)

    def _deliver_at(self, direction: LinkDirection, nbytes: int, now: float) -> float:
        return direction.deliver_at(nbytes, now, cap_bytes_per_s=self.faults.bandwidth_bytes_per_s(),
                                    extra_latency_s=self.faults.extra_latency_s())

    def send_at(self, nbytes: int) -> float:
        """When a learner->syncer message of `nbytes` booked now reaches the syncer."""
        return self._deliver_at(self.uplink, nbytes, self.clock.now())

    def receive_at(self, nbytes: int, arrived_at: float | None = None) -> float:
        """When a syncer->learner message of `nbytes`, read off the socket at `arrived_at`, may be
        handed to the learner."""
        return self._deliver_at(self.downlink, nbytes, self.clock.now() if arrived_at is None else arrived_at)


def unlimited_link(clock: Clock | None = None, *, faults: LinkFaults = NO_FAULTS) -> EmulatedLink:
    """No shaping: infinite bandwidth, zero latency (the identity link, so callers need no `if`)."""
    return EmulatedLink(LinkConfig(bandwidth_bps=math.inf, latency_s=0.0), clock=clock, faults=faults)
