"""A silent partition (a pulled cable, a NAT that forgot the connection: no FIN, no RST, nothing more arrives) ends the
gRPC connection within the keepalive's time plus its ping timeout, on the options the syncer and its learners share
(`grpc_common.CHANNEL_OPTIONS`). Before, `grpc.keepalive_timeout_ms` alone was set, and grpcio 1.85 waits for a ping's
answer as long as `grpc.http2.ping_timeout_ms` says (60 s by default): a learner behind a dead link read itself
connected, trained about one step a minute and lost what it sent, for 60-70 s (measured through a proxy that froze
the connection, with real ddiloco processes and with the bare channel below).

Real gRPC on 127.0.0.1 through a real TCP proxy that stops forwarding without closing anything.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from ddiloco.transport import grpc_common
from ddiloco.transport.grpc_server import _bind_error
from tests.proxies import TcpProxy

pytestmark = pytest.mark.integration

KEEPALIVE_MS = 1_000
"""The test's ping period (shipped: 10 s), so that the ping timeout under test dominates the wait."""
NOTICED_WITHIN_S = 30.0
"""Ping period plus the shipped 5 s ping timeout is about 6 s; without an effective ping timeout it is 61 s."""


class FreezingProxy(TcpProxy):
    """Forwards TCP both ways between its port and `target` until `freeze()`, then reads and sends nothing more while
    keeping every socket open: to either end the peer is simply silent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.frozen = threading.Event()
        super().__init__(target)

    def passes(self, to_client: bool, received: float) -> bool:
        return not self.frozen.is_set()  # swallowed once frozen: nothing gets through any more, and nothing is closed

    def freeze(self) -> None:
        self.frozen.set()


def _options(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(k, KEEPALIVE_MS if k == "grpc.keepalive_time_ms" else v) for k, v in options]


def _idle_stream(request: bytes, context: grpc.ServicerContext):
    while context.is_active():
        time.sleep(0.1)
    yield from ()


def test_a_silent_partition_ends_an_idle_stream_within_the_ping_timeout():
    server = grpc.server(futures.ThreadPoolExecutor(4), options=_options(grpc_common.CHANNEL_OPTIONS) + [
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.S", {"Stream": grpc.unary_stream_rpc_method_handler(_idle_stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = FreezingProxy(("127.0.0.1", port))
    channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=_options(grpc_common.CHANNEL_OPTIONS))
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_stream("/t.S/Stream")(b"")
        time.sleep(2 * KEEPALIVE_MS / 1000)  # pings answered through the proxy: the stream stays up
        assert call.running()
        proxy.freeze()
        frozen_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        waited = time.monotonic() - frozen_at
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        assert waited < NOTICED_WITHIN_S, f"the dead link was noticed after {waited:.1f} s"
    finally:
        channel.close()
        server.stop(None)
        proxy.close()


def test_a_port_in_use_is_named_as_such():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        reason = _bind_error(f"127.0.0.1:{taken.getsockname()[1]}")
    assert reason is not None and "in use" in reason, reason
    assert "assign" in (_bind_error("10.255.255.1:5000") or "")
