"""The syncer's gRPC calls: authentication, wire validation, and streams in and out.

`SyncerServicer` is a thin shell between the network and a `SyncerHandler` (`syncer_handler`). Per call it

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

Error statuses carry the rejection reason in the trailing metadata key `ddiloco-reason`. Serving the calls (the
event loop, the thread pool, the port) is `grpc_server`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from typing import NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from ddiloco.checkpoint import strict_dumps
from ddiloco.messages import (
    SCHEMA_VERSION,
    FragmentDelta,
    FragmentState,
    Heartbeat,
    Leave,
    RejectReason,
    SyncerMessage,
    Welcome,
)
from ddiloco.transport import wire_pb2, wire_pb2_grpc
from ddiloco.transport.auth import learner_of_token
from ddiloco.transport.genesis_codec import GenesisAssembler
from ddiloco.transport.grpc_codec import (
    MAX_LEARNER_ID,
    UpdateAssembler,
    WireError,
    decode_join,
    shortened,
)
from ddiloco.transport.grpc_common import (
    NO_GENESIS,
    REASON_KEY,
    SCHEMA_KEY,
    SESSION_KEY,
    TOKEN_KEY,
)
from ddiloco.transport.shared_chunks import SharedChunks
from ddiloco.transport.subscription import Subscription, _Newest
from ddiloco.transport.syncer_handler import STOPPED, SyncerHandler
from ddiloco.transport.syncer_stream import encode_syncer_message
from ddiloco.update_values import DecodeBuffers

T = TypeVar("T")

MAX_SESSION_CHARS = 200
OPERATOR = -1
"""The identity of a call carrying the run token (status, evaluators): the operator's, no learner's."""
CHUNK_TIMEOUT_S = 60.0
"""An upload (update or genesis) that sends no chunk for this long is refused (`truncated`)."""
UPLOADS_PER_LEARNER = 4
"""Updates one learner may have in flight at once (its sender sends one at a time)."""
INLINE_ENCODE_BYTES = 1 << 20
"""Messages up to this size are encoded on the event loop (a CRC of 1 MiB takes well under a millisecond)."""
WATCH_POLL_S = 0.1
"""How often a watcher (an evaluator) asks whether newer rounds have committed."""


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

    async def _check_learner_call(self, context: grpc.aio.ServicerContext, learner_id: int) -> int:
        """A learner's own small call (heartbeat, leave): token, schema, a valid id, that learner's token; the id."""
        identity = await self._check_call(context)
        try:
            self._check_learner_id(learner_id)
        except WireError as exc:
            await self._refuse(context, exc, None)
        await self._check_identity(context, identity, int(learner_id))
        return int(learner_id)

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
        learner_id = await self._check_learner_call(context, request.learner_id)
        known = await self._off_loop(self.handler.heartbeat, Heartbeat(learner_id, max(0, int(request.inner_step))))
        return wire_pb2.HeartbeatReply(known=known)

    async def Leave(self, request: wire_pb2.LeaveRequest, context: grpc.aio.ServicerContext) -> wire_pb2.LeaveReply:
        learner_id = await self._check_learner_call(context, request.learner_id)
        await self._off_loop(self.handler.leave, Leave(learner_id))
        return wire_pb2.LeaveReply()

    async def Status(self, request: wire_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext) -> wire_pb2.StatusReply:
        await self._check_call(context)
        status = await self._off_loop(lambda: strict_dumps(self.handler.status(), sort_keys=True)[0])
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
