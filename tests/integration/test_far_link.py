"""A link whose round trip is long (a learner across an ocean, behind a satellite hop, a TLS handshake on a slow
path): a connection attempt is given `grpc_common.MIN_CONNECT_TIMEOUT_MS` to finish its handshake. Until 2026-12-07
the channel options set `grpc.min_reconnect_backoff_ms`, which gRPC core takes as the least time an attempt is given
(not a pause between attempts), to 100 ms: each attempt was cut after at most about 2.4 s, the longest backoff, so a
handshake slower than that never finished (a probe: over TLS at a 1.2 s round trip both learners exited
`unreachable`).

Real gRPC on 127.0.0.1 through a real TCP proxy that holds the server's bytes back.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from ddiloco.transport import grpc_common
from tests.helpers import TcpProxy

pytestmark = pytest.mark.integration

SERVER_DELAY_S = 3.0
"""How long the proxy holds every byte from the server: longer than the longest reconnect backoff (2 s + 20 %)."""


class DelayingProxy(TcpProxy):
    """Forwards TCP between its port and `target`: the client's bytes at once, the server's `delay_s` late."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.delay_s = delay_s
        super().__init__(target)

    def passes(self, to_client: bool, received: float) -> bool:
        if to_client:  # one chunk at a time: later ones arrived later, so each is held exactly delay_s
            time.sleep(max(0.0, received + self.delay_s - time.monotonic()))
        return True


def test_a_handshake_slower_than_the_reconnect_backoff_still_connects():
    server = grpc.server(futures.ThreadPoolExecutor(2), options=grpc_common.CHANNEL_OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = DelayingProxy(("127.0.0.1", port), SERVER_DELAY_S)
    channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=grpc_common.CHANNEL_OPTIONS)
    try:
        started = time.monotonic()
        grpc.channel_ready_future(channel).result(timeout=4 * SERVER_DELAY_S)
        assert time.monotonic() - started >= SERVER_DELAY_S
    finally:
        channel.close()
        server.stop(None)
        proxy.close()
