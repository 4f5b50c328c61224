"""Link emulation: parsing `BANDWIDTH,LATENCY`, the token bucket, per-direction delivery times."""

import math

import pytest

from ddiloco.clock import VirtualClock
from ddiloco.transport.link import EmulatedLink, LinkConfig, LinkDirection, TokenBucket, parse_link, unlimited_link


@pytest.mark.parametrize(("text", "bandwidth_bps", "latency_s"), [
    ("2.5gbit,40ms", 2.5e9, 0.04),
    ("100mbit,5ms", 1e8, 0.005),
    ("1gb,0ms", 8e9, 0.0),
    ("500kbit, 1.5s", 5e5, 1.5),
    ("10Mbps,250us", 1e7, 250e-6),
])
def test_parse_link(text, bandwidth_bps, latency_s):
    spec = parse_link(text)
    assert spec.bandwidth_bps == pytest.approx(bandwidth_bps)
    assert spec.latency_s == pytest.approx(latency_s)


@pytest.mark.parametrize(("text", "needle"), [
    ("fast", "BANDWIDTH,LATENCY"),
    ("2.5gbit", "BANDWIDTH,LATENCY"),
    ("2.5gbit,40", "latency"),
    ("2.5parsecs,40ms", "bandwidth"),
    ("0mbit,1ms", "more than 0"),
    ("-1mbit,1ms", "bandwidth"),
    ("1e400mbit,1ms", "link bandwidth '1e400mbit' is invalid: expected a finite number"),  # was taken as unlimited
    ("100mbit,1e400ms", "link latency '1e400ms' is invalid: expected a finite number"),
])
def test_parse_link_rejects_nonsense_with_a_clear_message(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_link(text)


def test_link_config_validates_fields():
    with pytest.raises(ValueError, match="bandwidth_bps"):
        LinkConfig(bandwidth_bps=0, latency_s=0.0)
    with pytest.raises(ValueError, match="latency_s"):
        LinkConfig(bandwidth_bps=1e6, latency_s=-1.0)


def test_token_bucket_queues_messages_at_the_rate():
    bucket = TokenBucket(rate_bytes_per_s=1000.0, burst_bytes=100.0)
    assert bucket.reserve(100, now=0.0) == 0.0  # the burst passes at once
    assert bucket.reserve(1000, now=0.0) == pytest.approx(1.0)  # then 1000 bytes take 1 s
    # Booked at 0.5 s, behind the previous message: 500 more bytes leave at 1.5 s.
    assert bucket.reserve(500, now=0.5) == pytest.approx(1.5)
    # An idle link refills up to the burst only.
    assert bucket.reserve(100, now=10.0) == 10.0
    assert bucket.reserve(100, now=10.0) == pytest.approx(10.1)


def test_direction_adds_latency_after_serialisation():
    direction = LinkDirection(LinkConfig(bandwidth_bps=8e6, latency_s=0.04))  # 1 MB/s
    burst = direction.bucket.burst_bytes
    assert direction.deliver_at(1_000_000 + int(burst), now=2.0) == pytest.approx(2.0 + 1.0 + 0.04)


def test_directions_are_independent_and_latencies_overlap():
    clock = VirtualClock()
    link = EmulatedLink(LinkConfig(bandwidth_bps=8e9, latency_s=0.1), clock=clock)
    first = link.send_at(1000)
    second = link.send_at(1000)
    assert first == pytest.approx(0.1) and second == pytest.approx(0.1)  # not 0.2: propagation overlaps
    assert link.receive_at(1000) == pytest.approx(0.1)
    clock.advance_to(5.0)
    assert link.receive_at(1000, arrived_at=4.0) == pytest.approx(4.1)


def test_two_and_a_half_gigabit_moves_a_fragment_in_the_expected_time():
    link = EmulatedLink(parse_link("2.5gbit,40ms"), clock=VirtualClock())
    nbytes = 50_000_000  # 400 Mbit: 0.16 s at 2.5 Gbit/s, less the burst that leaves at once
    burst = link.uplink.bucket.burst_bytes
    assert link.send_at(nbytes) == pytest.approx((nbytes - burst) * 8 / 2.5e9 + 0.04)
    assert link.send_at(nbytes) == pytest.approx(0.2 - 0.001 + 0.16, abs=1e-9)  # queued behind the first


def test_unlimited_link_is_the_identity():
    clock = VirtualClock(start_s=3.0)
    link = unlimited_link(clock)
    assert link.send_at(10**12) == 3.0
    assert link.receive_at(10**12) == 3.0
    assert math.isinf(link.spec.bandwidth_bps)


def test_the_harness_and_the_runtime_queue_messages_by_one_model():
    # ddiloco.link_model: a burst queues first in first out at the rate, then crosses the latency. The
    # harness's link (virtual time) and the runtime's bandwidth cap (any clock) give the same deliveries.
    from ddiloco.link_model import SerialPipe
    from ddiloco.sim.links import Link

    simulated = Link(LinkConfig(latency_s=0.05, bandwidth_bps=8000.0))  # 1000 bytes per second
    emulated = LinkDirection(LinkConfig(bandwidth_bps=math.inf, latency_s=0.05))
    sends = [(0.0, 100), (0.0, 300), (0.2, 100), (2.0, 500)]
    harness = [simulated.send(now, nbytes) for now, nbytes in sends]
    runtime = [emulated.deliver_at(nbytes, now, cap_bytes_per_s=1000.0) for now, nbytes in sends]
    assert harness == pytest.approx([0.15, 0.45, 0.55, 2.55])
    assert runtime == pytest.approx(harness)
    pipe = SerialPipe()
    assert [pipe.send(now, nbytes / 1000.0) for now, nbytes in sends] == pytest.approx([0.1, 0.4, 0.5, 2.5])
    pipe.reset(1.0)
    assert pipe.send(0.5, 0.1) == pytest.approx(1.1)  # what was queued is gone; idle from the reset
