"""The syncer's gRPC server: the event loop its calls run on, the threads they block in, the port it listens on.

`start_server` serves a `SyncerHandler` (`syncer_handler`) through the calls of `SyncerServicer`
(`syncer_servicer`, which owns authentication, validation and the streams). The calls are coroutines on one
asyncio event loop (grpc.aio) in the server's own thread: a stream that waits holds no thread, so subscribers
and slow uploads cannot use up the server (the threaded server deadlocked at 64 streams); whatever may block runs
on a small thread pool.

The server registers the generated method handlers with a request deserializer that turns bytes which are not a
protobuf message into `Undecodable`, so that the call itself refuses them as malformed, after its token check and
recorded, instead of gRPC ending it UNKNOWN.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import threading
from collections.abc import AsyncIterator
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError

from ddiloco.transport import wire_pb2_grpc
from ddiloco.transport.auth import split_host_port
from ddiloco.transport.call_checks import Undecodable
from ddiloco.transport.grpc_common import CHANNEL_OPTIONS, MIN_PING_INTERVAL_MS
from ddiloco.transport.syncer_handler import SyncerHandler
from ddiloco.transport.syncer_servicer import CHUNK_TIMEOUT_S, SyncerServicer

logger = logging.getLogger(__name__)

DEFAULT_HANDLER_THREADS = 16
"""Threads the server's calls block in (the syncer's lock, decoding, encoding). Streams hold none."""
STOP_GRACE_S = 2.0


async def _decodable(chunks: AsyncIterator) -> AsyncIterator:
    """The chunks of a client stream, raising the WireError of the first undecodable one (which the streaming
    calls refuse like any bad chunk)."""
    async for chunk in chunks:
        if isinstance(chunk, Undecodable):
            raise chunk.error
        yield chunk


def _tolerant(servicer: SyncerServicer, method: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`method` with a request deserializer that turns bad bytes into `Undecodable`, refused by the call."""
    parse = method.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(exc)

    kind = ("stream_" if method.request_streaming else "unary_") + ("stream" if method.response_streaming else "unary")
    behaviour = getattr(method, kind)
    # grpc.aio tells a coroutine handler from a generator by its function: the wrapper must stay a coroutine.
    assert inspect.iscoroutinefunction(behaviour), f"{kind} handlers here are coroutines that write their replies"

    async def call(request_or_chunks, context: grpc.aio.ServicerContext):
        if method.request_streaming:
            return await behaviour(_decodable(request_or_chunks), context)
        if isinstance(request_or_chunks, Undecodable):
            await servicer.refuse_undecodable(context, request_or_chunks)
        return await behaviour(request_or_chunks, context)

    return method._replace(request_deserializer=deserialize, **{kind: call})


class _Registry:
    """Takes the method handlers the generated `add_SyncerServicer_to_server` registers, to wrap them."""

    def __init__(self) -> None:
        self.service = ""
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same methods, registered by name below

    def add_registered_method_handlers(self, service: str, methods: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.methods = service, methods


def _bind_error(bind: str) -> str | None:
    """Why this machine cannot listen on `bind`, as the OS says it (`Address already in use`, `Cannot assign requested
    address`), found by binding a plain socket there: gRPC's own error says only that it failed. None when the
    plain socket could bind (the cause is gRPC's) or the address does not parse."""
    try:
        host, port = split_host_port(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            probe.bind((host, port))
    except ValueError:
        return None
    except OSError as exc:
        return f"{exc.strerror or exc} (errno {exc.errno})" if exc.errno is not None else str(exc)
    return None


def _add_servicer(servicer: SyncerServicer, server: grpc.aio.Server) -> None:
    generated = _Registry()
    wire_pb2_grpc.add_SyncerServicer_to_server(servicer, generated)
    assert generated.methods, "the generated code registers its methods by name"
    methods = {name: _tolerant(servicer, method) for name, method in generated.methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(generated.service, methods),))
    server.add_registered_method_handlers(generated.service, methods)


class SyncerServer:
    """A started server: grpc.aio on an event loop in its own thread, with the pool its calls block in."""

    def __init__(self, handler: SyncerHandler, bind: str, *, token: str | None, tls: tuple[bytes, bytes] | None,
                 handler_threads: int, chunk_timeout_s: float) -> None:
        self._loop = asyncio.new_event_loop()
        self._pool = futures.ThreadPoolExecutor(max_workers=handler_threads, thread_name_prefix="syncer-rpc")
        self._thread = threading.Thread(target=self._loop.run_forever, name="syncer-grpc", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        servicer = SyncerServicer(handler, token=token, pool=self._pool, chunk_timeout_s=chunk_timeout_s)
        try:
            self._server, self.port = asyncio.run_coroutine_threadsafe(self._start(servicer, bind, tls),
                                                                       self._loop).result()
        except BaseException:
            self._shut_down()
            raise

    async def _start(self, servicer: SyncerServicer, bind: str,
                     tls: tuple[bytes, bytes] | None) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0),
                                          ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS)])
        _add_servicer(servicer, server)
        try:
            if tls is None:
                port = server.add_insecure_port(bind)
            else:
                port = server.add_secure_port(bind, grpc.ssl_server_credentials([tls]))
        except RuntimeError as exc:
            # `read_tls_files` has parsed the certificate and key and matched them: what is left is the address.
            over = " over TLS" if tls is not None else ""
            raise ValueError(f"cannot listen on {bind}{over}: {_bind_error(bind) or exc}") from None
        if port == 0:
            raise ValueError(f"cannot listen on {bind}: {_bind_error(bind) or 'the address is in use or invalid'}")
        await server.start()
        return server, port

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (calls in flight get `grace` seconds); the returned event is set once it has stopped."""
        if not self._stopped.is_set() and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()
            finally:
                self._shut_down()
        return self._stopped

    def _shut_down(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop.close()
        self._stopped.set()


def start_server(handler: SyncerHandler, bind: str, *, token: str | None,
                 tls: tuple[bytes, bytes] | None = None, handler_threads: int = DEFAULT_HANDLER_THREADS,
                 chunk_timeout_s: float = CHUNK_TIMEOUT_S) -> tuple[SyncerServer, int]:
    """Serve on `bind` (HOST:PORT; port 0 picks a free one). `tls` = (private key PEM, certificate
    PEM). Returns the started server and the port it listens on."""
    server = SyncerServer(handler, bind, token=token, tls=tls, handler_threads=handler_threads,
                          chunk_timeout_s=chunk_timeout_s)
    return server, server.port
