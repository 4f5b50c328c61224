"""Real TCP proxies on 127.0.0.1 for the tests of links (`tests/integration/test_dead_link.py`,
`test_far_link.py`): one that forwards both ways, and one with a long round trip; a test's subclass decides what
else a link does (freezes, say)."""

from __future__ import annotations

import collections
import socket
import threading
import time


class TcpProxy:
    """A real TCP proxy on 127.0.0.1: forwards both ways between its `port` and `target`, each direction on a thread of
    its own. A subclass decides what passes (`passes`): a link that freezes, one with a long round trip."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for source, sink, to_client in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(source, sink, to_client), daemon=True).start()

    def _pump(self, source, sink, to_client: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self.passes(to_client, time.monotonic()):
                continue  # swallowed
            try:
                sink.sendall(data)
            except OSError:
                return

    def passes(self, to_client: bool, received: float) -> bool:
        """Whether bytes received at `received` (monotonic) go on, towards the client or the server; may hold them."""
        return True

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


class DelayingProxy(TcpProxy):
    """A link with a long round trip: every byte goes on `to_client_s` (towards the client) or `to_server_s` (towards
    the server) after it arrived, whatever follows it (latency, not bandwidth: a writer thread per direction)."""

    def __init__(self, target: tuple[str, int], *, to_client_s: float = 0.0, to_server_s: float = 0.0) -> None:
        self.to_client_s, self.to_server_s = to_client_s, to_server_s
        super().__init__(target)

    def _pump(self, source, sink, to_client: bool) -> None:
        delay_s = self.to_client_s if to_client else self.to_server_s
        held: collections.deque = collections.deque()
        arrived = threading.Condition()

        def deliver() -> None:
            while True:
                with arrived:
                    arrived.wait_for(lambda: held)
                    due, data = held.popleft()
                if data is None:
                    return
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=deliver, daemon=True).start()
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            with arrived:
                held.append((time.monotonic() + delay_s, data or None))
                arrived.notify()
            if not data:
                return
