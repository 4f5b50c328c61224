"""The syncer's gRPC calls: authentication, wire validation, and streams in and out.

`SyncerServicer` is a thin shell between the network and a `SyncerHandler` (`syncer_handler`). Per call it

1. authenticates: the run token (metadata `ddiloco-token`, compared in constant time) and the
   schema version (metadata `ddiloco-schema-version`); a wrong token ends the call with
   UNAUTHENTICATED, a wrong schema with FAILED_PRECONDITION, both recorded as rejections;
2. validates every byte against the model (`WireModel`) before the handler sees it: a bad header is
   refused before its data is read, an oversize stream at its first extra byte (RESOURCE_EXHAUSTED),
   a truncated one when it ends; bytes that are not a protobuf message at all are refused as malformed
   (`Undecodable`) rather than left to gRPC; each refusal is recorded (also when the call is cancelled
   meanwhile, its client having died) and the server keeps serving. An upload's header is checked, and its
   sender, before any memory is taken for its data; a refused upload lets go of what it received at once;
3. streams: `Subscribe` is the join, and then stays open as the learner's downlink, fed from its
   `Subscription` (bounded: a subscriber that does not read holds at most one pending state per
   fragment; a stream replaced by a later join of its learner stops at once, even in the middle of a message;
   at most STREAMS_PER_LEARNER open); `PushUpdate` reassembles an update from its chunks (each within
   CHUNK_TIMEOUT_S, at most UPLOADS_PER_LEARNER at once); `PushGenesis` a new run's initial parameters (read
   only after a Subscribe was answered `no_genesis` and while the run has none, one per learner at a time,
   within what the syncer could hold: `genesis_limit_bytes`); `Watch` streams the whole global model to a
   read-only subscriber (an evaluator, with the run token; at most WATCHES_AT_ONCE) as rounds commit.

Error statuses carry the rejection reason in the trailing metadata key `ddiloco-reason`. The authentication of
step 1, and how a refused call is recorded and ends, are `call_checks`'s (`CallChecks`, which `SyncerServicer`
extends); serving the calls (the event loop, the thread pool, the port) is `grpc_server`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from typing import TypeVar

import grpc

from ddiloco.checkpoint import strict_dumps
from ddiloco.messages import (
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
from ddiloco.transport.call_checks import OPERATOR, CallChecks
from ddiloco.transport.genesis_codec import Genesis, GenesisAssembler, genesis_limit_bytes
from ddiloco.transport.grpc_codec import (
    UpdateAssembler,
    WireError,
    decode_config,
    decode_join,
    shortened,
)
from ddiloco.transport.grpc_common import (
    ANOTHER_PROCESS,
    NO_GENESIS,
    REASON_KEY,
    SESSION_KEY,
)
from ddiloco.transport.shared_chunks import SharedChunks
from ddiloco.transport.subscription import Subscription, _Newest
from ddiloco.transport.syncer_handler import STOPPED, AnotherProcess, SyncerHandler
from ddiloco.transport.syncer_stream import encode_syncer_message
from ddiloco.update_values import DecodeBuffers

T = TypeVar("T")

MAX_SESSION_CHARS = 200
CHUNK_TIMEOUT_S = 60.0
"""An upload (update or genesis) that sends no chunk for this long is refused (`truncated`)."""
UPLOADS_PER_LEARNER = 4
"""Updates one learner may have in flight at once (its sender sends one at a time)."""
STREAMS_PER_LEARNER = 4
"""Subscribe calls one learner may have open at once. A learner reads one; a stream it replaced by joining again
stays open until its client cancels it (a ddiloco learner does so before it joins again) or goes away (a few,
while a connection dies half-open)."""
WATCHES_AT_ONCE = 4
"""Watch calls open at once, all callers together. An evaluator holds one; a watcher that does not read holds a
copy of the global model and its encoding (8 bytes per parameter) until it reads or goes away."""
INLINE_ENCODE_BYTES = 1 << 20
"""Messages up to this size are encoded on the event loop (a CRC of 1 MiB takes well under a millisecond)."""
WATCH_POLL_S = 0.1
"""How often a watcher (an evaluator) asks whether newer rounds have committed."""


def call_session(context: grpc.aio.ServicerContext) -> str:
    """The process a call names (metadata `ddiloco-session`), or "" when it names none."""
    return str(dict(context.invocation_metadata() or ()).get(SESSION_KEY, ""))[:MAX_SESSION_CHARS]


def _detached(error: WireError) -> WireError:
    """`error` without its traceback and context, whose frames hold the upload's last chunks and buffer: gRPC keeps the
    exception that `abort` raises next, and through the refusing frame in its traceback it would keep them too."""
    error.__context__ = error.__cause__ = None
    return error.with_traceback(None)


class _Stream:
    """One open Subscribe call of a learner."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        """The call's own task (its handler)."""
        self.subscription: Subscription | None = None
        """None until the join is answered."""
        self.sending = False
        """Whether the call is sending its subscription's messages (and may be cancelled out of it)."""
        self.replaced = False
        """Whether a later join of the same learner has replaced this stream's subscription: it stops sending."""


class SyncerServicer(CallChecks, wire_pb2_grpc.SyncerServicer):
    """The calls, as coroutines on the server's event loop: a stream waiting for its next message or chunk
    holds no thread, so any number of learners can be subscribed or uploading at once. Work that may block
    (the handler's calls, which take the syncer's lock; decoding and encoding tensors) runs on a small pool of
    threads (`handler_threads`)."""

    def __init__(self, handler: SyncerHandler, *, token: str | None, pool: futures.ThreadPoolExecutor,
                 chunk_timeout_s: float = CHUNK_TIMEOUT_S, max_genesis_bytes: int | None = None) -> None:
        """`max_genesis_bytes`: the largest genesis a header may declare (None: `genesis_limit_bytes()`, what this
        machine could hold)."""
        self.handler = handler
        self._token = token.encode() if token else None
        self._pool = pool
        self._chunk_timeout_s = chunk_timeout_s
        self._max_genesis_bytes = genesis_limit_bytes() if max_genesis_bytes is None else max_genesis_bytes
        # The counts below are only touched on the event loop.
        self._uploads: collections.Counter[int] = collections.Counter()
        """Updates in flight per learner."""
        self._genesis_uploads: set[int] = set()
        """Learners pushing a genesis now."""
        self._genesis_asked = False
        """Whether a Subscribe was answered `no_genesis`: before that, no genesis is read."""
        self._streams: dict[int, list[_Stream]] = {}
        """Open Subscribe calls per learner."""
        self._watches = 0
        """Open Watch calls."""
        self.shared_chunks = SharedChunks(self._encode)
        self.decode_buffers = DecodeBuffers()

    async def _off_loop(self, function: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(function, *args,
                                                                                              **kwargs))

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

    # ---- calls ------------------------------------------------------------------------------------

    async def Subscribe(self, request: wire_pb2.JoinRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[wire_pb2.SyncerChunk]:
        identity = await self._check_call(context)
        try:
            join, config = decode_join(request)
        except WireError as exc:
            await self._refuse(context, exc, None)
        learner_id = join.learner_id
        await self._check_identity(context, identity, learner_id)
        streams = self._streams.setdefault(learner_id, [])
        if len(streams) >= STREAMS_PER_LEARNER:
            await self._refuse(context, WireError(
                "too_many_streams", f"learner {learner_id} already has {STREAMS_PER_LEARNER} subscriptions open (one "
                "it replaced by joining again stays open until its client cancels it or goes away)",
                grpc.StatusCode.RESOURCE_EXHAUSTED), learner_id)
        stream = _Stream()
        streams.append(stream)
        try:
            stream.subscription = await self._join(context, join, config)
            for other in self._streams[learner_id]:  # this join closed the subscription it replaced
                if other.subscription is not None and other.subscription.closed and not other.replaced:
                    other.replaced = True
                    if other.sending:  # stopped at once, even in the middle of a message
                        other.task.cancel()
            await self._send_stream(context, learner_id, stream)
        finally:
            streams = self._streams[learner_id]
            streams.remove(stream)
            if not streams:
                del self._streams[learner_id]

    async def _join(self, context: grpc.aio.ServicerContext, join: Join, config: dict) -> Subscription:
        """The learner's subscription, or the call ends with the refusal."""
        answer = await self._off_loop(self.handler.join, join, config, context.peer(), call_session(context))
        if answer is NO_GENESIS:
            self._genesis_asked = True
            context.set_trailing_metadata(((REASON_KEY, NO_GENESIS),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{NO_GENESIS}: the run has no global model yet; push the initial parameters")
        if answer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer is shutting down")
        if isinstance(answer, str):
            context.set_trailing_metadata(((REASON_KEY, ANOTHER_PROCESS if isinstance(answer, AnotherProcess)
                                            else "refused"),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused: {shortened(answer)}")
        return answer

    async def _send_stream(self, context: grpc.aio.ServicerContext, learner_id: int, stream: _Stream) -> None:
        subscription = stream.subscription
        assert subscription is not None, "joined first"
        try:
            stream.sending = True
            try:
                await self._send_all(context, subscription)
            except asyncio.CancelledError:
                # Cancelled by a later join of this learner (`replaced`: on below), or by gRPC because the call
                # ended (also when both did: a cancellation is left once this join's is taken back).
                if not stream.replaced or asyncio.current_task().uncancel():
                    raise
            finally:
                stream.sending = False
            if stream.replaced or self._superseded(learner_id, stream):
                # A later join of this learner replaced the stream: it sends nothing more, and has let go of the
                # message it was sending and of those queued. What gRPC still holds for it (the chunk in flight,
                # bytes its client has not read) is freed only when the call ends, which only its client can do (a
                # ddiloco learner cancels its stream before it joins again): until then the stream stays open and
                # counts for its learner.
                subscription.discard()
                await asyncio.get_running_loop().create_future()  # cancelled by gRPC when the call ends
        except grpc.aio.InternalError:
            pass  # a write failed, the call having ended: gRPC would log it as the servicer's error, with a traceback
        finally:
            # The learner went away, the subscription was replaced or closed, or the server stops: the service
            # counts the learner as gone (unless it was replaced).
            subscription.discard()
            with contextlib.suppress(RuntimeError):  # the pool is gone: the server has stopped, so has the service
                self._pool.submit(self.handler.subscription_ended, subscription)

    def _superseded(self, learner_id: int, stream: _Stream) -> bool:
        """Whether a later Subscribe of the same learner is open: its join closed this stream's subscription, which may
        have ended the stream before that call could mark it `replaced`."""
        streams = self._streams[learner_id]
        return streams.index(stream) < len(streams) - 1

    async def _send_all(self, context: grpc.aio.ServicerContext, subscription: Subscription) -> None:
        """Send the subscription's messages until it ends."""
        while (item := await subscription.next()) is not None:
            queued_at, message = item
            if isinstance(message, _Newest):  # takes the syncer's lock
                message = await self._off_loop(subscription.resolve, message)
            for chunk in await self._encoded(message):
                await context.write(chunk)
            subscription.delivered(message, queued_at)

    async def PushUpdate(self, request_iterator: AsyncIterator,
                         context: grpc.aio.ServicerContext) -> wire_pb2.UpdateReply:
        identity = await self._check_call(context)
        model = await self._off_loop(self.handler.wire_model)
        if model is None:
            await self._refuse(context, WireError(str(RejectReason.UNKNOWN_LEARNER), "the run has no global model "
                                                  "yet: join first", grpc.StatusCode.NOT_FOUND), None)
        assembler = UpdateAssembler(model, buffers=self.decode_buffers)
        try:
            update = await self._receive_update(request_iterator, identity, call_session(context), assembler)
        except WireError as exc:
            refusal = _detached(exc)
        except asyncio.CancelledError:
            header = assembler.header
            self._record_cancelled(context, "update", int(header.learner_id) if header is not None else None, header)
            raise
        else:
            refusal = None
        if refusal is not None:
            # Refused outside the `except` clause, and with the bytes let go first: the exception `abort` raises is
            # kept by gRPC, and with the clause's exception as its context it would keep this frame's buffer (until
            # the garbage collector found the cycle).
            header = assembler.header
            assembler.release()
            await self._refuse(context, refusal, int(header.learner_id) if header is not None else None, header)
        # Shielded: a call cancelled once its update is complete loses neither its fate (the core's verdict) nor
        # gives its decode buffers back while the core still reads them.
        accepted, reason, detail = await asyncio.shield(self._off_loop(self._apply, update, assembler))
        return wire_pb2.UpdateReply(accepted=accepted, reason=reason, detail=detail)

    async def _receive_update(self, requests: AsyncIterator, identity: int | None, session: str,
                              assembler: UpdateAssembler) -> Update:
        first = await self._next_chunk(requests, "update")
        if first is None:
            raise WireError("truncated", "the update stream ended before its header")
        learner_id = int(assembler.check_header(first).learner_id)  # nothing is allocated for the data yet
        error = self._identity_error(identity, learner_id)
        if error is not None:
            raise error
        if not await self._off_loop(self.handler.is_member, learner_id):
            raise WireError(str(RejectReason.UNKNOWN_LEARNER),
                            f"learner {learner_id} has not joined (or was timed out): join first",
                            grpc.StatusCode.NOT_FOUND)
        replaced = await self._off_loop(self.handler.replaced, learner_id, session)
        if replaced is not None:
            raise WireError(ANOTHER_PROCESS, replaced, grpc.StatusCode.FAILED_PRECONDITION)
        if self._uploads[learner_id] >= UPLOADS_PER_LEARNER:
            raise WireError("too_many_uploads", f"learner {learner_id} already has {UPLOADS_PER_LEARNER} "
                            "updates in flight", grpc.StatusCode.RESOURCE_EXHAUSTED)
        self._uploads[learner_id] += 1
        try:
            assembler.add_data(first.data)
            while (chunk := await self._next_chunk(requests, "update")) is not None:
                assembler.add(chunk)
            return await self._off_loop(assembler.finish)
        finally:
            self._uploads[learner_id] -= 1
            if not self._uploads[learner_id]:
                del self._uploads[learner_id]

    def _apply(self, update: Update, assembler: UpdateAssembler) -> tuple[bool, str, str]:
        try:
            return self.handler.update(update)
        finally:
            # The core has added the decoded values to its round's sums (it keeps none of them) or rejected them.
            assembler.release()

    async def Heartbeat(self, request: wire_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> wire_pb2.HeartbeatReply:
        learner_id = await self._check_learner_call(context, request.learner_id)
        await self._check_process(context, learner_id)
        known = await self._off_loop(self.handler.heartbeat, Heartbeat(learner_id, max(0, int(request.inner_step))))
        return wire_pb2.HeartbeatReply(known=known)

    async def Leave(self, request: wire_pb2.LeaveRequest, context: grpc.aio.ServicerContext) -> wire_pb2.LeaveReply:
        learner_id = await self._check_learner_call(context, request.learner_id)
        await self._check_process(context, learner_id)
        await self._off_loop(self.handler.leave, Leave(learner_id))
        return wire_pb2.LeaveReply()

    async def _check_process(self, context: grpc.aio.ServicerContext, learner_id: int) -> None:
        """A call from a process that another process of its learner id replaced is refused (`ANOTHER_PROCESS`)."""
        replaced = await self._off_loop(self.handler.replaced, learner_id, call_session(context))
        if replaced is not None:
            await self._refuse(context, WireError(ANOTHER_PROCESS, replaced, grpc.StatusCode.FAILED_PRECONDITION),
                               learner_id)

    async def Status(self, request: wire_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext) -> wire_pb2.StatusReply:
        await self._check_call(context)
        status = await self._off_loop(lambda: strict_dumps(self.handler.status(), sort_keys=True)[0])
        return wire_pb2.StatusReply(status_json=status)

    async def PushGenesis(self, request_iterator: AsyncIterator,
                          context: grpc.aio.ServicerContext) -> wire_pb2.GenesisReply:
        identity = await self._check_call(context)
        assembler = GenesisAssembler(max_bytes=self._max_genesis_bytes)
        try:
            genesis = await self._receive_genesis(request_iterator, identity, assembler)
        except WireError as exc:
            refusal = _detached(exc)
        except asyncio.CancelledError:
            header = assembler.header
            self._record_cancelled(context, "genesis", int(header.learner_id) if header is not None else None)
            raise
        else:
            refusal = None
        if refusal is not None:  # as in PushUpdate: outside the clause, the bytes let go first
            header = assembler.header
            assembler.release()
            await self._refuse(context, refusal, int(header.learner_id) if header is not None else None)
        if isinstance(genesis, str):
            return wire_pb2.GenesisReply(accepted=False, detail=genesis)
        accepted, detail = await self._off_loop(self.handler.genesis, genesis, context.peer())
        return wire_pb2.GenesisReply(accepted=accepted, detail=detail)

    async def _receive_genesis(self, requests: AsyncIterator, identity: int | None,
                               assembler: GenesisAssembler) -> Genesis | str:
        """The genesis a learner proposes, or why the run does not want one (answered before its data is read)."""
        first = await self._next_chunk(requests, "genesis")
        if first is None:
            raise WireError("truncated", "the genesis stream ended before its header")
        learner_id = int(assembler.check_header(first).learner_id)  # its declared size is bounded; nothing allocated
        error = self._identity_error(identity, learner_id)
        if error is not None:
            raise error
        if await self._off_loop(self.handler.wire_model) is not None:
            return "the run already has its genesis"
        if not self._genesis_asked:
            return ("the syncer did not ask for a genesis (the run's comes from its --init file, or no learner has "
                    "subscribed yet): subscribe first")
        if learner_id in self._genesis_uploads:
            raise WireError("too_many_uploads", f"learner {learner_id} is pushing a genesis already",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)
        self._genesis_uploads.add(learner_id)
        try:
            assembler.add_data(first.data)  # the buffer grows with the bytes that arrive
            while (chunk := await self._next_chunk(requests, "genesis")) is not None:
                assembler.add(chunk)
        finally:
            self._genesis_uploads.discard(learner_id)
        return await self._off_loop(assembler.finish)

    async def Watch(self, request: wire_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[wire_pb2.SyncerChunk]:
        identity = await self._check_call(context)
        if identity is not None and identity != OPERATOR:
            await self._refuse(context, WireError(
                "unauthenticated", f"a watch carries learner {identity}'s token, which proves that learner only: "
                "watching the global model is the operator's (an evaluator presents the run token)",
                grpc.StatusCode.UNAUTHENTICATED), identity)
        interval = request.min_interval_s
        if not (math.isfinite(interval) and interval >= 0):
            await self._refuse(context, WireError("malformed", f"min_interval_s={interval} is invalid: expected >= 0"),
                               None)
        try:
            declared = decode_config(request.run_config_json, "run_config_json") or None
        except WireError as exc:
            await self._refuse(context, exc, None)
        refusal = None if declared is None else await self._off_loop(self.handler.watch_refusal, declared)
        if refusal is not None:
            await self._refuse(context, WireError("refused", refusal, grpc.StatusCode.FAILED_PRECONDITION), None)
        if self._watches >= WATCHES_AT_ONCE:
            await self._refuse(context, WireError(
                "too_many_watches", f"{WATCHES_AT_ONCE} watches are open already (a watcher that does not read holds "
                "a copy of the model until it goes away)", grpc.StatusCode.RESOURCE_EXHAUSTED), None)
        self._watches += 1
        try:
            await self._watch(context, interval)
        except grpc.aio.InternalError:
            pass  # as in Subscribe: a write failed, the call having ended
        finally:
            self._watches -= 1

    async def _watch(self, context: grpc.aio.ServicerContext, interval: float) -> None:
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
