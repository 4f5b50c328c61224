"""The syncer's gRPC server: authentication, wire validation, and streams in and out.

The server is a thin shell between the network and a `SyncerHandler` (the syncer service of
`ddiloco.runtime`, which owns the Syncer core and its lock). Per call it

1. authenticates: the run token (metadata `ddiloco-token`, compared in constant time) and the
   schema version (metadata `ddiloco-schema-version`); a wrong token ends the call with
   UNAUTHENTICATED, a wrong schema with FAILED_PRECONDITION, both recorded as rejections;
2. validates every byte against the model (`WireModel`) before the handler sees it: a bad header is
   refused before its data is read, an oversize stream at its first extra byte (RESOURCE_EXHAUSTED),
   a truncated one when it ends; bytes that are not a protobuf message at all are refused as malformed
   (`Undecodable`) rather than left to gRPC; each refusal is recorded and the server keeps serving;
3. streams: `Subscribe` is the join, and then stays open as the learner's downlink, fed from its
   `Subscription` (bounded: a subscriber that does not read holds at most one pending state per
   fragment); `PushUpdate` reassembles an update from its chunks (each within CHUNK_TIMEOUT_S, at most
   UPLOADS_PER_LEARNER at once); `PushGenesis` a new run's initial parameters (after a Subscribe refused
   with `no_genesis`); `Watch` streams the whole global model to a read-only subscriber (an evaluator) as
   rounds commit.

The calls are coroutines on one asyncio event loop (grpc.aio): a stream that waits holds no thread, so
subscribers and slow uploads cannot use up the server (the threaded server deadlocked at 64 streams);
whatever may block runs on a small thread pool.

Error statuses carry the rejection reason in the trailing metadata key `ddiloco-reason`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import inspect
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from typing import NoReturn, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from ddiloco.messages import (
    SCHEMA_VERSION,
    FragmentDelta,
    FragmentState,
    Heartbeat,
    Join,
    Leave,
    RejectReason,
    SyncerMessage,
    Update,
    Welcome,
)
from ddiloco.transport import wire_pb2, wire_pb2_grpc
from ddiloco.transport.auth import learner_of_token
from ddiloco.transport.genesis_codec import Genesis, GenesisAssembler
from ddiloco.transport.grpc_codec import (
    MAX_LEARNER_ID,
    UpdateAssembler,
    WireError,
    WireModel,
    decode_join,
    shortened,
)
from ddiloco.transport.grpc_common import (
    CHANNEL_OPTIONS,
    MIN_PING_INTERVAL_MS,
    NO_GENESIS,
    REASON_KEY,
    SCHEMA_KEY,
    SESSION_KEY,
    TOKEN_KEY,
)
from ddiloco.transport.shared_chunks import SharedChunks
from ddiloco.transport.subscription import Subscription, _Newest
from ddiloco.transport.syncer_stream import encode_syncer_message
from ddiloco.update_values import DecodeBuffers

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_SESSION_CHARS = 200
OPERATOR = -1
"""The identity of a call carrying the run token (status, evaluators): the operator's, no learner's."""
DEFAULT_HANDLER_THREADS = 16
"""Threads the server's calls block in (the syncer's lock, decoding, encoding). Streams hold none."""
CHUNK_TIMEOUT_S = 60.0
"""An upload (update or genesis) that sends no chunk for this long is refused (`truncated`)."""
UPLOADS_PER_LEARNER = 4
"""Updates one learner may have in flight at once (its sender sends one at a time)."""
INLINE_ENCODE_BYTES = 1 << 20
"""Messages up to this size are encoded on the event loop (a CRC of 1 MiB takes well under a millisecond)."""
WATCH_POLL_S = 0.1
"""How often a watcher (an evaluator) asks whether newer rounds have committed."""
STOPPED = "stopped"
"""`SyncerHandler.snapshot`'s answer once the syncer stops."""
STOP_GRACE_S = 2.0


def peer_host(peer: str) -> str:
    """A gRPC peer without its port ('ipv4:127.0.0.1:59704' -> 'ipv4:127.0.0.1'): each new connection of one
    client comes from another port."""
    host, _, port = peer.rpartition(":")
    return host if peer.startswith(("ipv4:", "ipv6:")) and port.isdigit() and ":" in host else peer


class SyncerHandler(Protocol):
    """What the server needs from the syncer service. Every method may block (the service's lock): the server
    calls them from its handler threads, never from its event loop."""

    def join(self, join: Join, diloco_config: dict, peer: str, session: str = "") -> Subscription | str | None:
        """A Subscription (whose first message is the Welcome), the refusal reason, or None when
        the syncer is shutting down (the learner retries later)."""
        ...

    def update(self, update: Update) -> tuple[bool, str, str]:
        """(accepted, reason, detail) of the syncer core."""
        ...

    def wire_model(self) -> WireModel | None:
        """What a well-formed update looks like, or None before the run has its genesis."""
        ...

    def genesis(self, genesis: Genesis, peer: str) -> tuple[bool, str]:
        """(accepted, detail): the proposed genesis became the run's global model, or why not."""
        ...

    def snapshot(self, after_round: int, not_before: float) -> tuple[int, Welcome] | str | None:
        """Without waiting: once more than `after_round` rounds have committed (at once when after_round is -1)
        and monotonic time `not_before` has come, (rounds committed, the whole global model); None while not;
        STOPPED when the syncer stops."""
        ...

    def is_member(self, learner_id: int) -> bool: ...

    def heartbeat(self, heartbeat: Heartbeat) -> bool: ...

    def leave(self, leave: Leave) -> None: ...

    def subscription_ended(self, subscription: Subscription) -> None: ...

    def status(self) -> dict: ...

    def record_rejection(self, reason: str, detail: str, *, learner_id: int | None, peer: str,
                         fragment: int | None = None, inner_step: int | None = None) -> None:
        """A refusal on the wire; `fragment` and `inner_step` come from the update's header once it
        has been checked (None before that, and for calls that are not updates)."""
        ...


def _update_fields(header: wire_pb2.UpdateHeader | None) -> dict[str, int | None]:
    """fragment and inner_step of a checked update header, for a rejection record."""
    if header is None:
        return {"fragment": None, "inner_step": None}
    return {"fragment": int(header.fragment), "inner_step": int(header.inner_step)}


class SyncerServicer(wire_pb2_grpc.SyncerServicer):
    """The calls, as coroutines on the server's event loop: a stream waiting for its next message or chunk
    holds no thread, so any number of learners can be subscribed or uploading at once. Work that may block
    (the handler's calls, which take the syncer's lock; decoding and encoding tensors) runs on a small pool of
    threads (`handler_threads`)."""

    def __init__(self, handler: SyncerHandler, *, token: str | None, pool: futures.ThreadPoolExecutor,
                 chunk_timeout_s: float = CHUNK_TIMEOUT_S) -> None:
        self.handler = handler
        self._token = token.encode() if token else None
        self._pool = pool
        self._chunk_timeout_s = chunk_timeout_s
        self._uploads: collections.Counter[int] = collections.Counter()
        """Uploads in flight per learner (only touched on the event loop)."""
        self.shared_chunks = SharedChunks(self._encode)
        self.decode_buffers = DecodeBuffers()

    async def _off_loop(self, function: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(function, *args,
                                                                                              **kwargs))

    # ---- checks every call passes ----------------------------------------------------------------

    async def _refuse(self, context: grpc.aio.ServicerContext, error: WireError, learner_id: int | None,
                      header: wire_pb2.UpdateHeader | None = None) -> NoReturn:
        await self._off_loop(self.handler.record_rejection, error.reason, error.detail, learner_id=learner_id,
                             peer=context.peer(), **_update_fields(header))
        context.set_trailing_metadata(((REASON_KEY, error.reason),))
        await context.abort(error.status, f"{error.reason}: {error.detail}")
        raise AssertionError("abort returns only by raising")  # pragma: no cover

    async def _check_call(self, context: grpc.aio.ServicerContext) -> int | None:
        """Token and schema; who the caller is: OPERATOR (the run token), a learner id (its own token), or None
        when the server has no token (anyone)."""
        metadata = dict(context.invocation_metadata() or ())
        identity = None
        if self._token is not None:
            presented = str(metadata.get(TOKEN_KEY, ""))
            if hmac.compare_digest(presented.encode(), self._token):
                identity = OPERATOR
            else:
                identity = learner_of_token(self._token.decode(), presented)
            if identity is None:
                why = "no run token presented" if not presented else "wrong run token"
                await self._refuse(context, WireError(
                    "unauthenticated", f"{why}: start the learner with the syncer's --token-file or --token-env",
                    grpc.StatusCode.UNAUTHENTICATED), None)
        schema = metadata.get(SCHEMA_KEY)
        if schema != str(SCHEMA_VERSION):
            await self._refuse(context, WireError(
                "bad_schema", f"wire schema version {schema or 'missing'}, but the syncer speaks {SCHEMA_VERSION}: "
                "run the same ddiloco version everywhere", grpc.StatusCode.FAILED_PRECONDITION), None)
        return identity

    async def _check_identity(self, context: grpc.aio.ServicerContext, identity: int | None, learner_id: int,
                              header: wire_pb2.UpdateHeader | None = None) -> None:
        """A call acting for `learner_id` must carry that learner's own token (when the server has a token)."""
        if identity is None or identity == learner_id:
            return
        if identity == OPERATOR:
            why = (f"a call for learner {learner_id} carries the run token, which proves no learner: a learner "
                   "presents its own token (ddiloco derives it from the run token; `ddiloco token --learner N`)")
        else:
            why = f"a call for learner {learner_id} carries learner {identity}'s token: a learner acts only as itself"
        await self._refuse(context, WireError("unauthenticated", why, grpc.StatusCode.UNAUTHENTICATED), learner_id,
                           header)

    @staticmethod
    def _check_learner_id(learner_id: int) -> None:
        if not 0 <= learner_id <= MAX_LEARNER_ID:
            raise WireError(str(RejectReason.UNKNOWN_LEARNER), f"learner_id={learner_id} is invalid")

    async def _encoded(self, message: SyncerMessage) -> list[wire_pb2.SyncerChunk]:
        """A message's chunks: a round's broadcast encoded once for every subscription (`SharedChunks`), any other
        message for its one stream."""
        if isinstance(message, FragmentState | FragmentDelta):
            return await self.shared_chunks.chunks(message)
        return await self._encode(message)

    async def _encode(self, message: SyncerMessage) -> list[wire_pb2.SyncerChunk]:
        """Encoded on the loop when small (a thread hop costs more than the work), in the pool when its tensors
        are large."""
        size = message.payload_bytes if isinstance(message, FragmentState | FragmentDelta) else (
            sum(s.payload_bytes for s in message.fragments) if isinstance(message, Welcome) else 0)
        if size <= INLINE_ENCODE_BYTES:
            return list(encode_syncer_message(message))
        return await self._off_loop(lambda: list(encode_syncer_message(message)))

    async def _next_chunk(self, requests: AsyncIterator, what: str):
        """The next chunk of an upload, or None at its end; an upload silent for `chunk_timeout_s` is refused."""
        try:
            return await asyncio.wait_for(anext(requests), self._chunk_timeout_s)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise WireError("truncated", f"no chunk of the {what} for {self._chunk_timeout_s:g} s: the upload was "
                            "dropped", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    async def refuse_undecodable(self, context: grpc.aio.ServicerContext, request: Undecodable) -> NoReturn:
        await self._check_call(context)  # without the token it is unauthenticated, whatever its bytes are
        await self._refuse(context, request.error, None)

    # ---- calls ------------------------------------------------------------------------------------

    async def Subscribe(self, request: wire_pb2.JoinRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[wire_pb2.SyncerChunk]:
        identity = await self._check_call(context)
        try:
            join, config = decode_join(request)
        except WireError as exc:
            await self._refuse(context, exc, None)
        await self._check_identity(context, identity, join.learner_id)
        session = str(dict(context.invocation_metadata() or ()).get(SESSION_KEY, ""))[:MAX_SESSION_CHARS]
        answer = await self._off_loop(self.handler.join, join, config, context.peer(), session)
        if answer is NO_GENESIS:
            context.set_trailing_metadata(((REASON_KEY, NO_GENESIS),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{NO_GENESIS}: the run has no global model yet; push the initial parameters")
        if answer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer is shutting down")
        if isinstance(answer, str):
            context.set_trailing_metadata(((REASON_KEY, "refused"),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused: {shortened(answer)}")
        subscription: Subscription = answer
        try:
            while (item := await subscription.next()) is not None:
                queued_at, message = item
                if isinstance(message, _Newest):  # takes the syncer's lock
                    message = await self._off_loop(subscription.resolve, message)
                for chunk in await self._encoded(message):
                    await context.write(chunk)
                subscription.delivered(message, queued_at)
        finally:
            # The learner went away, the subscription was replaced or closed, or the server stops: the service
            # counts the learner as gone (unless it was replaced).
            subscription.discard()
            with contextlib.suppress(RuntimeError):  # the pool is gone: the server has stopped, so has the service
                self._pool.submit(self.handler.subscription_ended, subscription)

    async def PushUpdate(self, request_iterator: AsyncIterator,
                         context: grpc.aio.ServicerContext) -> wire_pb2.UpdateReply:
        identity = await self._check_call(context)
        model = await self._off_loop(self.handler.wire_model)
        if model is None:
            await self._refuse(context, WireError(str(RejectReason.UNKNOWN_LEARNER), "the run has no global model "
                                                  "yet: join first", grpc.StatusCode.NOT_FOUND), None)
        assembler = UpdateAssembler(model, buffers=self.decode_buffers)
        learner_id = None
        counted = False
        try:
            first = await self._next_chunk(request_iterator, "update")
            if first is None:
                raise WireError("truncated", "the update stream ended before its header")
            header = assembler.start(first)
            learner_id = int(header.learner_id)
            await self._check_identity(context, identity, learner_id, header)
            if not await self._off_loop(self.handler.is_member, learner_id):
                raise WireError(str(RejectReason.UNKNOWN_LEARNER),
                                f"learner {learner_id} has not joined (or was timed out): join first",
                                grpc.StatusCode.NOT_FOUND)
            if self._uploads[learner_id] >= UPLOADS_PER_LEARNER:
                raise WireError("too_many_uploads", f"learner {learner_id} already has {UPLOADS_PER_LEARNER} "
                                "updates in flight", grpc.StatusCode.RESOURCE_EXHAUSTED)
            self._uploads[learner_id] += 1
            counted = True
            while (chunk := await self._next_chunk(request_iterator, "update")) is not None:
                assembler.add(chunk)
            update = await self._off_loop(assembler.finish)
        except WireError as exc:
            await self._refuse(context, exc, learner_id, assembler.header)
        except asyncio.CancelledError:
            # The client cancelled mid-stream: nothing reached the syncer.
            self._pool.submit(self.handler.record_rejection, "truncated", "the client cancelled the update stream",
                              learner_id=learner_id, peer=context.peer(), **_update_fields(assembler.header))
            raise
        finally:
            if counted:
                self._uploads[learner_id] -= 1
                if not self._uploads[learner_id]:
                    del self._uploads[learner_id]
        try:
            accepted, reason, detail = await self._off_loop(self.handler.update, update)
        finally:
            # The core has added the decoded values to its round's sums (it keeps none of them) or rejected them.
            assembler.release()
        return wire_pb2.UpdateReply(accepted=accepted, reason=reason, detail=detail)

    async def Heartbeat(self, request: wire_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> wire_pb2.HeartbeatReply:
        identity = await self._check_call(context)
        try:
            self._check_learner_id(request.learner_id)
        except WireError as exc:
            await self._refuse(context, exc, None)
        await self._check_identity(context, identity, int(request.learner_id))
        known = await self._off_loop(self.handler.heartbeat,
                                     Heartbeat(int(request.learner_id), max(0, int(request.inner_step))))
        return wire_pb2.HeartbeatReply(known=known)

    async def Leave(self, request: wire_pb2.LeaveRequest, context: grpc.aio.ServicerContext) -> wire_pb2.LeaveReply:
        identity = await self._check_call(context)
        try:
            self._check_learner_id(request.learner_id)
        except WireError as exc:
            await self._refuse(context, exc, None)
        await self._check_identity(context, identity, int(request.learner_id))
        await self._off_loop(self.handler.leave, Leave(int(request.learner_id)))
        return wire_pb2.LeaveReply()

    async def Status(self, request: wire_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext) -> wire_pb2.StatusReply:
        await self._check_call(context)
        status = await self._off_loop(lambda: json.dumps(self.handler.status(), sort_keys=True))
        return wire_pb2.StatusReply(status_json=status)

    async def PushGenesis(self, request_iterator: AsyncIterator,
                          context: grpc.aio.ServicerContext) -> wire_pb2.GenesisReply:
        identity = await self._check_call(context)
        assembler = GenesisAssembler()
        try:
            first = await self._next_chunk(request_iterator, "genesis")
            if first is None:
                raise WireError("truncated", "the genesis stream ended before its header")
            assembler.start(first)
            await self._check_identity(context, identity, int(assembler.header.learner_id))
            while (chunk := await self._next_chunk(request_iterator, "genesis")) is not None:
                assembler.add(chunk)
            genesis = await self._off_loop(assembler.finish)
        except WireError as exc:
            learner_id = int(assembler.header.learner_id) if assembler.header is not None else None
            await self._refuse(context, exc, learner_id)
        accepted, detail = await self._off_loop(self.handler.genesis, genesis, context.peer())
        return wire_pb2.GenesisReply(accepted=accepted, detail=detail)

    async def Watch(self, request: wire_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[wire_pb2.SyncerChunk]:
        await self._check_call(context)
        interval = request.min_interval_s
        if not (math.isfinite(interval) and interval >= 0):
            await self._refuse(context, WireError("malformed", f"min_interval_s={interval} is invalid: expected >= 0"),
                               None)
        after, not_before = -1, 0.0
        while True:
            answer = await self._off_loop(self.handler.snapshot, after, not_before)
            if answer == STOPPED:
                return
            if answer is None:
                await asyncio.sleep(WATCH_POLL_S)  # a watcher waits on the loop, holding no thread
                continue
            after, welcome = answer
            for chunk in await self._encoded(welcome):
                await context.write(chunk)
            not_before = time.monotonic() + interval  # the service's clock: MonotonicClock


class Undecodable:
    """A request whose bytes are not its protobuf message (bad UTF-8 in a string field, a cut field). gRPC's own
    deserializer would end the call UNKNOWN with a traceback in the log, before any token is checked and with
    nothing recorded; instead the call passes the usual checks and is refused as malformed."""

    def __init__(self, error: DecodeError) -> None:
        self.error = WireError("malformed", f"the request is not a valid protobuf message: {error}")


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
            raise ValueError(f"cannot listen on {bind}: {exc}") from None
        if port == 0:
            raise ValueError(f"cannot listen on {bind}: the address is in use or invalid")
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
