"""The syncer's gRPC server: authentication, wire validation, and streams in and out.

The server is a thin shell between the network and a `SyncerHandler` (the syncer service of
`ddiloco.runtime`, which owns the Syncer core and its lock). Per call it

1. authenticates: the run token (metadata `ddiloco-token`, compared in constant time) and the
   schema version (metadata `ddiloco-schema-version`); a wrong token ends the call with
   UNAUTHENTICATED, a wrong schema with FAILED_PRECONDITION, both recorded as rejections;
2. validates every byte against the model (`WireModel`) before the handler sees it: a bad header is
   refused before its data is read, an oversize stream at its first extra byte (RESOURCE_EXHAUSTED),
   a truncated one when it ends; each refusal is recorded and the server keeps serving;
3. streams: `Subscribe` is the join, and then stays open as the learner's downlink, fed from its
   `Subscription` queue; `PushUpdate` reassembles an update from its chunks; `PushGenesis` a new run's
   initial parameters (after a Subscribe refused with `no_genesis`); `Watch` streams the whole global
   model to a read-only subscriber (an evaluator) as rounds commit.

Error statuses carry the rejection reason in the trailing metadata key `ddiloco-reason`.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Protocol

import grpc

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
from ddiloco.transport.genesis_codec import Genesis, GenesisAssembler
from ddiloco.transport.grpc_codec import (
    MAX_LEARNER_ID,
    MAX_MESSAGE_BYTES,
    UpdateAssembler,
    WireError,
    WireModel,
    decode_join,
)
from ddiloco.transport.syncer_stream import encode_syncer_message

logger = logging.getLogger(__name__)

TOKEN_KEY = "ddiloco-token"
SCHEMA_KEY = "ddiloco-schema-version"
REASON_KEY = "ddiloco-reason"
KEEPALIVE_TIME_MS = 10_000
"""HTTP/2 pings every 10 s on idle connections, so a dead peer on another machine is noticed."""
KEEPALIVE_TIMEOUT_MS = 5_000
MIN_PING_INTERVAL_MS = 5_000
"""The server accepts pings this often (must not exceed the clients' keepalive time)."""
DEFAULT_MAX_WORKERS = 64
"""Server threads. Each subscribed learner holds one for its stream; the rest serve short calls."""
STOP_GRACE_S = 2.0
RECONNECT_BACKOFF_MS = (100, 2_000)
"""(first, longest) delay between a client channel's reconnection attempts."""

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's own reconnect backoff grows to minutes by default; a learner waiting for a restarted
    # syncer should find it within a couple of seconds.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
]
"""Options shared by the server and its clients."""


class Subscription:
    """One learner's downlink: the messages the syncer sends it, in order, until closed."""

    _CLOSED = object()

    def __init__(self, learner_id: int, *,
                 on_delivered: Callable[[FragmentState | FragmentDelta, float], None] | None = None) -> None:
        self.learner_id = learner_id
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._on_delivered = on_delivered
        self.closed = False

    def put(self, message: SyncerMessage) -> None:
        if not self.closed:
            self._queue.put((time.monotonic(), message))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put(self._CLOSED)

    def chunks(self) -> Iterator[wire_pb2.SyncerChunk]:
        """Blocks for the next message; ends when the subscription is closed."""
        while True:
            item = self._queue.get()
            if item is self._CLOSED:
                return
            queued_at, message = item
            yield from encode_syncer_message(message)
            if isinstance(message, FragmentState | FragmentDelta) and self._on_delivered is not None:
                # The last chunk has been handed to gRPC's flow control: the sync time the adaptive
                # grace window estimates (commit -> fragment on its way to the learner).
                self._on_delivered(message, time.monotonic() - queued_at)


NO_GENESIS = "no_genesis"
"""The reason of a Subscribe refused because the run has no global model yet (the learner then pushes its
initial parameters with PushGenesis and subscribes again)."""


class SyncerHandler(Protocol):
    """What the server needs from the syncer service. Every method is called from server threads."""

    def join(self, join: Join, diloco_config: dict, peer: str) -> Subscription | str | None:
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

    def snapshot(self, after_round: int, not_before: float) -> tuple[int, Welcome] | None:
        """Blocks until more than `after_round` rounds have committed (at once when after_round is -1)
        and monotonic time `not_before` has come; (rounds committed, the whole global model). None when
        the syncer stops."""
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
    def __init__(self, handler: SyncerHandler, *, token: str | None) -> None:
        self.handler = handler
        self._token = token.encode() if token else None

    # ---- checks every call passes ----------------------------------------------------------------

    def _refuse(self, context: grpc.ServicerContext, error: WireError, learner_id: int | None,
                header: wire_pb2.UpdateHeader | None = None) -> None:
        self.handler.record_rejection(error.reason, error.detail, learner_id=learner_id, peer=context.peer(),
                                      **_update_fields(header))
        context.set_trailing_metadata(((REASON_KEY, error.reason),))
        context.abort(error.status, f"{error.reason}: {error.detail}")

    def _check_call(self, context: grpc.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata())
        if self._token is not None:
            presented = metadata.get(TOKEN_KEY, "").encode()
            if not hmac.compare_digest(presented, self._token):
                why = "no run token presented" if not presented else "wrong run token"
                self._refuse(context, WireError(
                    "unauthenticated", f"{why}: start the learner with the syncer's --token-file or --token-env",
                    grpc.StatusCode.UNAUTHENTICATED), None)
        schema = metadata.get(SCHEMA_KEY)
        if schema != str(SCHEMA_VERSION):
            self._refuse(context, WireError(
                "bad_schema", f"wire schema version {schema or 'missing'}, but the syncer speaks {SCHEMA_VERSION}: "
                "run the same ddiloco version everywhere", grpc.StatusCode.FAILED_PRECONDITION), None)

    @staticmethod
    def _check_learner_id(learner_id: int) -> None:
        if not 0 <= learner_id <= MAX_LEARNER_ID:
            raise WireError(str(RejectReason.UNKNOWN_LEARNER), f"learner_id={learner_id} is invalid")

    # ---- calls ------------------------------------------------------------------------------------

    def Subscribe(self, request: wire_pb2.JoinRequest, context: grpc.ServicerContext) -> Iterator[wire_pb2.SyncerChunk]:
        self._check_call(context)
        try:
            join, config = decode_join(request)
        except WireError as exc:
            self._refuse(context, exc, None)
            return
        answer = self.handler.join(join, config, context.peer())
        if answer is NO_GENESIS:
            context.set_trailing_metadata(((REASON_KEY, NO_GENESIS),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{NO_GENESIS}: the run has no global model yet; push the initial parameters")
            return
        if answer is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer is shutting down")
            return
        if isinstance(answer, str):
            context.set_trailing_metadata(((REASON_KEY, "refused"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused: {answer}")
            return
        # When the learner goes away (or the server stops), the stream ends: close the queue so
        # the generator returns, and let the service count the learner as gone.
        def ended() -> None:
            answer.close()
            self.handler.subscription_ended(answer)

        if not context.add_callback(ended):  # the call is already over
            ended()
            return
        yield from answer.chunks()

    def PushUpdate(self, request_iterator, context: grpc.ServicerContext) -> wire_pb2.UpdateReply:
        self._check_call(context)
        model = self.handler.wire_model()
        if model is None:
            self._refuse(context, WireError(str(RejectReason.UNKNOWN_LEARNER), "the run has no global model yet: "
                                            "join first", grpc.StatusCode.NOT_FOUND), None)
            return wire_pb2.UpdateReply()
        assembler = UpdateAssembler(model)
        learner_id = None
        try:
            first = next(request_iterator, None)
            if first is None:
                raise WireError("truncated", "the update stream ended before its header")
            header = assembler.start(first)
            learner_id = int(header.learner_id)
            if not self.handler.is_member(learner_id):
                raise WireError(str(RejectReason.UNKNOWN_LEARNER),
                                f"learner {learner_id} has not joined (or was timed out): join first",
                                grpc.StatusCode.NOT_FOUND)
            for chunk in request_iterator:
                assembler.add(chunk)
            update = assembler.finish()
        except WireError as exc:
            self._refuse(context, exc, learner_id, assembler.header)
            return wire_pb2.UpdateReply()
        except grpc.RpcError:
            # The client cancelled mid-stream: nothing reached the syncer.
            self.handler.record_rejection("truncated", "the client cancelled the update stream",
                                          learner_id=learner_id, peer=context.peer(),
                                          **_update_fields(assembler.header))
            return wire_pb2.UpdateReply()
        accepted, reason, detail = self.handler.update(update)
        return wire_pb2.UpdateReply(accepted=accepted, reason=reason, detail=detail)

    def Heartbeat(self, request: wire_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> wire_pb2.HeartbeatReply:
        self._check_call(context)
        try:
            self._check_learner_id(request.learner_id)
        except WireError as exc:
            self._refuse(context, exc, None)
        known = self.handler.heartbeat(Heartbeat(int(request.learner_id), max(0, int(request.inner_step))))
        return wire_pb2.HeartbeatReply(known=known)

    def Leave(self, request: wire_pb2.LeaveRequest, context: grpc.ServicerContext) -> wire_pb2.LeaveReply:
        self._check_call(context)
        try:
            self._check_learner_id(request.learner_id)
        except WireError as exc:
            self._refuse(context, exc, None)
        self.handler.leave(Leave(int(request.learner_id)))
        return wire_pb2.LeaveReply()

    def Status(self, request: wire_pb2.StatusRequest, context: grpc.ServicerContext) -> wire_pb2.StatusReply:
        self._check_call(context)
        return wire_pb2.StatusReply(status_json=json.dumps(self.handler.status(), sort_keys=True))

    def PushGenesis(self, request_iterator, context: grpc.ServicerContext) -> wire_pb2.GenesisReply:
        self._check_call(context)
        assembler = GenesisAssembler()
        try:
            first = next(request_iterator, None)
            if first is None:
                raise WireError("truncated", "the genesis stream ended before its header")
            assembler.start(first)
            for chunk in request_iterator:
                assembler.add(chunk)
            genesis = assembler.finish()
        except WireError as exc:
            learner_id = int(assembler.header.learner_id) if assembler.header is not None else None
            self._refuse(context, exc, learner_id)
            return wire_pb2.GenesisReply()
        except grpc.RpcError:
            return wire_pb2.GenesisReply()  # cancelled mid-stream: nothing reached the syncer
        accepted, detail = self.handler.genesis(genesis, context.peer())
        return wire_pb2.GenesisReply(accepted=accepted, detail=detail)

    def Watch(self, request: wire_pb2.WatchRequest, context: grpc.ServicerContext) -> Iterator[wire_pb2.SyncerChunk]:
        self._check_call(context)
        interval = request.min_interval_s
        if not (math.isfinite(interval) and interval >= 0):
            self._refuse(context, WireError("malformed", f"min_interval_s={interval} is invalid: expected >= 0"), None)
            return
        after, not_before = -1, 0.0
        while context.is_active():
            answer = self.handler.snapshot(after, not_before)
            if answer is None:
                return
            after, welcome = answer
            yield from encode_syncer_message(welcome)
            not_before = time.monotonic() + interval  # the service's clock: MonotonicClock


def start_server(handler: SyncerHandler, bind: str, *, token: str | None,
                 tls: tuple[bytes, bytes] | None = None,
                 max_workers: int = DEFAULT_MAX_WORKERS) -> tuple[grpc.Server, int]:
    """Serve on `bind` (HOST:PORT; port 0 picks a free one). `tls` = (private key PEM, certificate
    PEM). Returns the started server and the port it listens on."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="syncer-rpc"),
        options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0),
                 ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS)])
    wire_pb2_grpc.add_SyncerServicer_to_server(SyncerServicer(handler, token=token), server)
    try:
        if tls is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, grpc.ssl_server_credentials([tls]))
    except RuntimeError as exc:
        raise ValueError(f"cannot listen on {bind}: {exc}") from None
    if port == 0:
        raise ValueError(f"cannot listen on {bind}: the address is in use or invalid")
    server.start()
    return server, port
