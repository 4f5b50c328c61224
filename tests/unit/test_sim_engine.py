"""The discrete-event loop and the simulated links of the virtual-time harness."""

import math

import pytest

from ddiloco.messages import Heartbeat, Update
from ddiloco.sim.engine import EventLoop
from ddiloco.sim.links import MESSAGE_HEADER_BYTES, Link, LinkConfig, message_nbytes


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    for time_s, name in [(2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "first")]:
        loop.schedule(time_s, name, lambda name=name: seen.append((loop.now, name)))
    loop.run()
    assert seen == [(0.5, "first"), (1.0, "a"), (1.0, "b"), (2.0, "c")]
    assert loop.events_handled == 4


def test_handlers_can_schedule_more_events_and_the_past_is_refused():
    loop, seen = EventLoop(), []

    def tick(n):
        seen.append(loop.now)
        if n:
            loop.schedule(loop.now + 1.5, "tick", tick, n=n - 1)

    loop.schedule(0.0, "tick", tick, n=3)
    loop.run()
    assert seen == [0.0, 1.5, 3.0, 4.5]
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.schedule(1.0, "late", lambda: None)


def test_run_stops_when_until_turns_true():
    loop, seen = EventLoop(), []
    for t in range(5):
        loop.schedule(float(t), "e", lambda t=t: seen.append(t))
    loop.run(until=lambda: len(seen) == 2)
    assert seen == [0, 1] and loop.pending() == 3


def test_link_is_a_fifo_pipe_with_latency_and_bandwidth():
    link = Link(LinkConfig(latency_s=0.1, bandwidth_bps=8_000))  # 1000 bytes per second
    assert link.send(0.0, 500) == pytest.approx(0.6)  # 0.5 s on the wire, 0.1 s latency
    assert link.send(0.2, 1000) == pytest.approx(1.6)  # queues behind the first until 0.5 s
    assert link.send(5.0, 0) == pytest.approx(5.1)  # an idle link again
    assert link.bytes_sent == 1500 and link.messages_sent == 3
    link.send(6.0, 10_000)
    link.reset(6.5)  # the endpoint died: nothing queued any more
    assert link.send(6.5, 0) == pytest.approx(6.6)


def test_message_sizes_count_the_payload_and_an_envelope():
    update = Update(0, 1, 0, 8, 8, 64, "int4", {"a": b"x" * 100, "b": b"y" * 20})
    assert message_nbytes(update) == 120 + MESSAGE_HEADER_BYTES
    assert message_nbytes(Heartbeat(0, 3)) == MESSAGE_HEADER_BYTES


@pytest.mark.parametrize("field, value", [("latency_s", -1.0), ("bandwidth_bps", 0.0), ("latency_s", math.inf)])
def test_link_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        LinkConfig(**{field: value})
