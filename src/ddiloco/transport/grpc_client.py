"""A learner's gRPC client of the syncer: join and subscribe, push updates, heartbeats, leave.

One `SyncerClient` owns one channel. gRPC reconnects the channel by itself; the caller (the learner
process's I/O threads) decides when to re-subscribe (`ddiloco.backoff.Backoff`). Every message passes
through the learner's `EmulatedLink`: uploads are held back until the link would have delivered them, and each
downloaded message carries the time at which the link would have handed it over. Bytes on the wire
(serialised chunks) are counted in both directions.

Errors: calls raise `grpc.RpcError`. `classify(error)` sorts them into a refusal (wrong token,
schema, model or config: the learner must stop), a rejection with a reason (the syncer refused this
update or does not know the learner), or a transient fault (the syncer is unreachable: retry later).

Injected faults (the link's `LinkFaults`, from a chaos control file) act here, on whole messages:

- partition: push, heartbeat, leave and a new subscribe fail at once with a `ChaosFault` (a transient
  UNAVAILABLE error, "chaos: partitioned from the syncer"); downlink messages that arrive meanwhile
  are discarded while the stream stays open, so the syncer notices only by the missing heartbeats
  (a silent partition). `take_downlink_missed()` then tells the caller to re-join for a fresh state.
- drop: an update or heartbeat is lost before it is sent (a `ChaosFault`); a downlink message is lost
  before the learner sees it, which ends the subscription so that the caller re-joins.
- corrupt: one byte of the message's tensor data is inverted in flight, after its CRC32 was computed;
  the syncer refuses such an update as `corrupt`, and the downlink decoder raises a `WireError`.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from ddiloco.checks import invalid
from ddiloco.config import DilocoConfig
from ddiloco.messages import SCHEMA_VERSION, Join, SyncerMessage, Update, Welcome
from ddiloco.transport import wire_pb2, wire_pb2_grpc
from ddiloco.transport.auth import token_for_learner
from ddiloco.transport.genesis_codec import Genesis, encode_genesis
from ddiloco.transport.grpc_codec import (
    WireModel,
    encode_join,
    encode_update,
    flip_data_byte,
)
from ddiloco.transport.grpc_common import CHANNEL_OPTIONS, NO_GENESIS, REASON_KEY, SCHEMA_KEY, SESSION_KEY, TOKEN_KEY
from ddiloco.transport.link import EmulatedLink, check_link, unlimited_link
from ddiloco.transport.syncer_stream import SyncerStreamDecoder

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
"""Deadline of the short calls (heartbeat, leave, status)."""
PUSH_TIMEOUT_S = 60.0
"""Deadline of one update upload (generous: an emulated slow link takes its time)."""
FLOAT32_BYTES = 4
"""A Welcome carries the global model as float32."""


class Fault(enum.Enum):
    REFUSED = "refused"
    """The syncer will not take this learner (token, schema, model, config): stop."""
    REJECTED = "rejected"
    """The syncer refused one message; the learner may go on (and re-join if it is unknown)."""
    TRANSIENT = "transient"
    """Unreachable, timed out, cancelled: try again later."""
    NO_GENESIS = "no_genesis"
    """A new run's syncer has no global model yet: push this learner's initial parameters
    (`push_genesis`), then subscribe again."""


_REFUSAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.FAILED_PRECONDITION)


class ChaosFault(grpc.RpcError):
    """A message the transport itself kept from the syncer because an injected fault said so. It
    reads like an UNAVAILABLE status, so callers treat it as any transient fault; `reason` says which
    fault ("partition" or "drop")."""

    def __init__(self, reason: str, details: str) -> None:
        super().__init__(details)
        self.reason = reason
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


PARTITIONED = "chaos: partitioned from the syncer"


def drop_reason(error: grpc.RpcError) -> str:
    """Why a message that never reached the syncer was lost: "partition" or "drop" (injected faults),
    else "unreachable" (a real transport error)."""
    return error.reason if isinstance(error, ChaosFault) else "unreachable"


def error_reason(error: grpc.RpcError) -> str:
    """The `ddiloco-reason` a syncer attached to an error status, or ''."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == REASON_KEY:
            return str(value)
    return ""


def classify(error: grpc.RpcError) -> Fault:
    code = error.code() if callable(getattr(error, "code", None)) else None
    if error_reason(error) == NO_GENESIS:
        return Fault.NO_GENESIS
    if code in _REFUSAL_CODES:
        return Fault.REFUSED
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return Fault.REJECTED
    return Fault.TRANSIENT


def error_text(error: grpc.RpcError) -> str:
    details = error.details() if callable(getattr(error, "details", None)) else None
    code = error.code() if callable(getattr(error, "code", None)) else None
    text = f"{getattr(code, 'name', code)}: {details or error}"
    if error_reason(error) == "bad_schema" and "ddiloco --version" not in text:
        # A syncer of an older version does not say how to tell the versions apart.
        text += f" (this process speaks wire schema {SCHEMA_VERSION}; `ddiloco --version` shows each one's)"
    return text


UNREACHABLE_WARN_AFTER = 3
"""Failed attempts in a row before a learner warns that it cannot reach the syncer: one or two are the
ordinary cost of a channel reconnecting, not news (each attempt is logged at DEBUG)."""
UNREACHABLE_WARN_EVERY_S = 30.0
"""While the syncer stays unreachable the warning is repeated at most this often, not once per attempt."""
HANDSHAKE_GIVE_UP_AFTER = 3
"""Failed TLS handshakes of one kind after which a learner that never reached its syncer gives up, at once rather
than after its connect timeout: a certificate, a name or a protocol that does not match stays so until someone
changes a flag, whereas a syncer that restarts refuses connections for a while (`Connection refused`, retried).
More than one: a syncer killed in the middle of a handshake cuts one short."""

_HANDSHAKE_FAILURES = (
    (("certificate has expired",),  # before the CA's line: gRPC's error holds both
     "the syncer's certificate has expired: give the syncer a new --tls-cert and --tls-key (signed by the same CA, "
     "learners need no change), or check this machine's clock"),
    (("certificate is not yet valid",),
     "the syncer's certificate is not valid yet (its start date is in the future): check the clocks of this machine "
     "and of the machine that issued it, or give the syncer a certificate valid now"),
    (("CERTIFICATE_VERIFY_FAILED",),
     "the syncer's certificate is not signed by the CA this process trusts: give --tls-ca the certificate of the CA "
     "that signed the syncer's --tls-cert (for a self-signed certificate, that certificate itself)"),
    (("Hostname Verification Check failed", "is not in peer certificate"),
     "the syncer's certificate does not hold the name checked (--tls-server-name when given, else the host dialled): "
     "give --tls-server-name a name the certificate holds (its subjectAltName: `openssl x509 -noout -ext "
     "subjectAltName -in CERT`), or dial the syncer by that name"),
    (("WRONG_VERSION_NUMBER",),
     "the syncer does not speak TLS but this process does: TLS is on one side only; drop --tls-ca, or start the "
     "syncer with --tls-cert and --tls-key"),
    (("Socket closed",),
     "the syncer closes every connection before answering: if it serves TLS (--tls-cert), TLS is on one side only "
     "and this process needs --tls-ca with the CA that signed its certificate; else check that the address is the "
     "syncer's"),
    (("Failed parsing HTTP/2", "Expected SETTINGS frame"),
     "what answers at this address does not speak gRPC, so it is not a syncer (a web server? another service?): "
     "check the address and port (a syncer writes its own to its run directory's syncer.json)"),
)
"""(what gRPC's error says, the likely fix) of a handshake that will fail again the same way: a TLS one, or a peer
that answers in another protocol."""


def _handshake(error: str) -> str:
    """Which handshake the transport error `error` failed: gRPC's own (HTTP/2), or TLS."""
    return "HTTP/2 handshake" if "HTTP/2" in error or "SETTINGS frame" in error else "TLS handshake"


def handshake_failure(error: str) -> str | None:
    """The likely fix when the transport error `error` is a TLS handshake that will fail again (an untrusted
    certificate, a name it does not hold, TLS on one side only), else None."""
    for marks, fix in _HANDSHAKE_FAILURES:
        if any(mark in error for mark in marks):
            return fix
    return None


@dataclass(frozen=True)
class Verdict:
    """What one failed attempt to reach the syncer calls for."""

    warning: str | None = None
    """A line to log at WARNING now (None: log the attempt at DEBUG only)."""
    give_up: str | None = None
    """Why the learner stops trying (None: retry after the backoff)."""


class ConnectWatch:
    """When a learner that cannot reach its syncer says so, and when it gives up. Time is passed in.

    A learner that has never had an answer from the syncer gives up once `connect_timeout_s` has passed
    since `started_at` (0: never): that is a wrong address, a syncer that is not running, a firewall. One
    that has had an answer retries forever: a syncer restarting mid-run comes back on the same address,
    and its learners must come back to it however long that takes. Either way it warns after
    `UNREACHABLE_WARN_AFTER` failed attempts in a row, then at most every `UNREACHABLE_WARN_EVERY_S`.

    A TLS handshake that fails is not a syncer that is away (`handshake_failure`): one that never answered gives up
    after `HANDSHAKE_GIVE_UP_AFTER` such failures of one kind, naming the likely fix (the CA file,
    `--tls-server-name`, TLS on one side only); one that has answered before keeps retrying (a syncer restarted
    with the wrong certificate can be restarted again with the right one), its warnings naming the fix.
    """

    def __init__(self, address: str, *, connect_timeout_s: float, started_at: float) -> None:
        if not connect_timeout_s >= 0:
            raise invalid("connect_timeout_s", connect_timeout_s, "seconds >= 0 (0: no bound)")
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.started_at = started_at
        self.ever_reached = False
        self._failures = 0
        self._failing_since = started_at
        self._warned_at: float | None = None
        self._handshakes: dict[str, int] = {}
        """Failed TLS handshakes since the syncer last answered, by their likely fix."""

    def reached(self) -> None:
        """The syncer answered (a Welcome, or any reply that is not a transport error)."""
        self.ever_reached = True
        self._failures = 0
        self._warned_at = None
        self._handshakes.clear()

    def failed(self, now: float, error: str) -> Verdict:
        """One more attempt failed with `error` (a transport error: the syncer did not answer)."""
        if self._failures == 0:
            self._failing_since = now if self.ever_reached else self.started_at
        self._failures += 1
        waited_s = now - self._failing_since
        fix = handshake_failure(error)
        if fix is not None:
            self._handshakes[fix] = self._handshakes.get(fix, 0) + 1
            if not self.ever_reached and self._handshakes[fix] >= HANDSHAKE_GIVE_UP_AFTER:
                return Verdict(give_up=f"cannot connect to the syncer at {self.address}: the {_handshake(error)} "
                                       f"failed {self._handshakes[fix]} times; {fix} (last error: {error})")
        # A host name with several addresses may end on one that refuses (IPv6 ::1) after one that failed the
        # handshake: the handshake is the news.
        seen = f"; {max(self._handshakes, key=self._handshakes.__getitem__)}" if self._handshakes else ""
        if not self.ever_reached and self.connect_timeout_s > 0 and now - self.started_at >= self.connect_timeout_s:
            return Verdict(give_up=f"cannot reach the syncer at {self.address}: no answer in "
                                   f"{self.connect_timeout_s:g} s ({self._failures} attempts; last error: "
                                   f"{error}{seen}). "
                                   f"Check the address, and that the syncer runs and can be reached from here; "
                                   f"the bound is the run config's learner.connect_timeout_s "
                                   f"(--connect-timeout-s; 0: none)")
        if self._failures < UNREACHABLE_WARN_AFTER:
            return Verdict()
        if self._warned_at is not None and now - self._warned_at < UNREACHABLE_WARN_EVERY_S:
            return Verdict()
        self._warned_at = now
        if self.ever_reached:
            return Verdict(warning=f"lost the syncer at {self.address} {_seconds(waited_s)} s ago ({self._failures} "
                                   f"attempts; last error: {error}{seen}); retrying until it answers")
        bound = (f"giving up {self.connect_timeout_s:g} s after the start" if self.connect_timeout_s > 0
                 else "without a bound")
        return Verdict(warning=f"cannot reach the syncer at {self.address} for {_seconds(waited_s)} s "
                               f"({self._failures} attempts; last error: {error}{seen}); retrying, {bound}")


def _seconds(value_s: float) -> str:
    return f"{value_s:.1f}" if value_s < 10 else f"{value_s:.0f}"


def parse_addresses(text: str) -> list[str]:
    """HOST:PORT[,HOST:PORT...] -> the addresses, each checked; ValueError naming a bad one."""
    from ddiloco.transport.auth import split_host_port

    addresses = [part.strip() for part in text.split(",")]
    for address in addresses:
        split_host_port(address)
    return addresses


class SyncerClient:
    """One learner's channel to the syncer. Thread-safe: one thread may subscribe while others push."""

    def __init__(self, address: str, *, model: WireModel, diloco_config: DilocoConfig, token: str | None = None,
                 tls_root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 link: EmulatedLink | None = None) -> None:
        """`address`: HOST:PORT, or several separated by commas (a syncer and its standbys on other hosts): the
        client dials the first and moves to the next when one cannot be reached (`next_address`).
        `tls_server_name`: the name to verify in the syncer's certificate; only with `tls_root_certificates`."""
        if tls_server_name and tls_root_certificates is None:
            raise ValueError(f"--tls-server-name {tls_server_name} is given without --tls-ca: the name is verified "
                             "only over TLS; give --tls-ca too (or drop --tls-server-name)")
        self.addresses = parse_addresses(address)
        self.address = self.addresses[0]
        self.model = model
        self.diloco_config = diloco_config
        self.link = link or unlimited_link()
        slow = check_link(self.link.spec, model_bytes=sum(t.numel for t in model.spec.tensors) * FLOAT32_BYTES)
        if slow is not None:
            logger.warning("%s", slow)
        self._tls = (tls_root_certificates, tls_server_name)
        self._channel, self._stub = self._connect(self.address)
        self._token = token
        self._metadata = ((SCHEMA_KEY, str(SCHEMA_VERSION)),) + (((TOKEN_KEY, token),) if token else ())
        self.session = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        """This process, as the syncer tells it apart from another one with the same learner id."""
        self._lock = threading.Lock()
        self._subscription: grpc.Call | None = None
        self._downlink_missed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.genesis_bytes_sent = 0
        """Of `bytes_sent`, the initial parameters this learner proposed (`push_genesis`): once a run, by its first
        learner, and as large as the model."""

    def _connect(self, address: str) -> tuple[grpc.Channel, wire_pb2_grpc.SyncerStub]:
        options = list(CHANNEL_OPTIONS)
        root_certificates, server_name = self._tls
        if root_certificates is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            channel = grpc.secure_channel(address, credentials, options=options)
        return channel, wire_pb2_grpc.SyncerStub(channel)

    def next_address(self) -> bool:
        """Dial the next of several syncer addresses (after this one could not be reached); False with one."""
        if len(self.addresses) < 2:
            return False
        with self._lock:
            old = self._channel
            self.address = self.addresses[(self.addresses.index(self.address) + 1) % len(self.addresses)]
            self._channel, self._stub = self._connect(self.address)
        old.close()
        return True

    def _as_learner(self, learner_id: int) -> tuple[tuple[str, str], ...]:
        """Metadata of a call acting for `learner_id`: its own token (derived here when given the run token) and this
        process's session."""
        token = ((TOKEN_KEY, token_for_learner(self._token, learner_id)),) if self._token else ()
        return ((SCHEMA_KEY, str(SCHEMA_VERSION)), *token, (SESSION_KEY, self.session))

    def _count(self, *, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _check_partition(self) -> None:
        if self.link.faults.partitioned():
            raise ChaosFault("partition", PARTITIONED)

    # ---- downlink -----------------------------------------------------------------------------------

    def subscribe(self, join: Join) -> Iterator[tuple[SyncerMessage, float]]:
        """Join and follow the downlink: (message, deliver_at) pairs until the stream ends. The first
        message is the Welcome; `deliver_at` is when the emulated link hands the message over."""
        self._check_partition()
        request = encode_join(join, self.diloco_config)
        self._count(sent=request.ByteSize())
        call = self._stub.Subscribe(request, metadata=self._as_learner(join.learner_id))
        with self._lock:
            self._subscription = call
        decoder = SyncerStreamDecoder(self.model)
        faults = self.link.faults
        counted = 0
        corrupt = False
        try:
            for chunk in call:
                if chunk.WhichOneof("kind") in ("welcome", "fragment_state", "fragment_delta"):  # tensors begin
                    corrupt = faults.should_corrupt()
                if corrupt and flip_data_byte(chunk):
                    corrupt = False
                message = decoder.feed(chunk)
                if message is None:
                    continue
                nbytes, counted = decoder.wire_bytes - counted, decoder.wire_bytes
                if faults.partitioned():
                    with self._lock:
                        self._downlink_missed = True
                    continue
                if faults.should_drop():
                    raise ChaosFault("drop", f"chaos: a {type(message).__name__} from the syncer was dropped")
                self._count(received=nbytes)
                yield message, self.link.receive_at(nbytes)
        finally:
            with self._lock:
                if self._subscription is call:
                    self._subscription = None
            call.cancel()

    def take_downlink_missed(self) -> bool:
        """True once after a partition discarded downlink messages: the learner's state is behind
        the syncer's, and only a re-join (a Welcome) brings it back in line."""
        with self._lock:
            missed, self._downlink_missed = self._downlink_missed, False
            return missed

    def cancel_subscription(self) -> None:
        """End the current subscription (its iterator raises a CANCELLED RpcError)."""
        with self._lock:
            call = self._subscription
        if call is not None:
            call.cancel()

    # ---- uplink ----------------------------------------------------------------------------------------

    def encode_update(self, update: Update) -> list[wire_pb2.UpdateChunk]:
        return list(encode_update(update, self.model.spec))

    def _check_send(self, what: str) -> None:
        """Injected faults on one uplink message, before it is sent: a partition, or a drop."""
        self._check_partition()
        if self.link.faults.should_drop():
            raise ChaosFault("drop", f"chaos: the {what} was dropped")

    def push(self, chunks: list[wire_pb2.UpdateChunk], *, timeout_s: float = PUSH_TIMEOUT_S) -> wire_pb2.UpdateReply:
        """Upload one update (its chunks from `encode_update`); the caller applies link timing."""
        self._check_send("update")
        if self.link.faults.should_corrupt():
            any(flip_data_byte(c) for c in chunks)  # the first chunk with data
        nbytes = sum(c.ByteSize() for c in chunks)
        reply = self._stub.PushUpdate(iter(chunks), metadata=self._as_learner(chunks[0].header.learner_id),
                                      timeout=timeout_s)
        self._count(sent=nbytes, received=reply.ByteSize())
        return reply

    def heartbeat(self, learner_id: int, inner_step: int, *, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        self._check_send("heartbeat")
        request = wire_pb2.HeartbeatRequest(learner_id=learner_id, inner_step=inner_step)
        reply = self._stub.Heartbeat(request, metadata=self._as_learner(learner_id), timeout=timeout_s)
        self._count(sent=request.ByteSize(), received=reply.ByteSize())
        return reply.known

    def leave(self, learner_id: int, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._check_partition()
        request = wire_pb2.LeaveRequest(learner_id=learner_id)
        self._stub.Leave(request, metadata=self._as_learner(learner_id), timeout=timeout_s)
        self._count(sent=request.ByteSize())

    def push_genesis(self, genesis: Genesis, *, timeout_s: float = PUSH_TIMEOUT_S) -> bool:
        """Propose this learner's initial parameters as the run's global model (after a NO_GENESIS
        refusal of Subscribe). True when they became the genesis; False when the run already has one."""
        self._check_partition()
        chunks = list(encode_genesis(genesis))
        reply = self._stub.PushGenesis(iter(chunks), metadata=self._as_learner(genesis.learner_id), timeout=timeout_s)
        sent = sum(c.ByteSize() for c in chunks)
        self._count(sent=sent, received=reply.ByteSize())
        with self._lock:
            self.genesis_bytes_sent += sent
        return reply.accepted

    def watch(self, *, min_interval_s: float, run_config: Mapping[str, Any] | None = None) -> Iterator[Welcome]:
        """A read-only subscription (an evaluator): the whole global model, at once and then after new
        rounds, at most every `min_interval_s`. Ends when the syncer stops or the call is cancelled. `run_config`: the
        run config (as a dict) the evaluator's model and data were built from, which the syncer checks, or None."""
        request = wire_pb2.WatchRequest(min_interval_s=min_interval_s, run_config_json="" if run_config is None
                                        else json.dumps(dict(run_config), sort_keys=True))
        call = self._stub.Watch(request, metadata=self._metadata)
        with self._lock:
            self._subscription = call
        decoder = SyncerStreamDecoder(self.model)
        try:
            for chunk in call:
                message = decoder.feed(chunk)
                if isinstance(message, Welcome):
                    yield message
        finally:
            with self._lock:
                if self._subscription is call:
                    self._subscription = None
            call.cancel()

    def status(self, *, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        reply = self._stub.Status(wire_pb2.StatusRequest(), metadata=self._metadata, timeout=timeout_s)
        return json.loads(reply.status_json)

    def close(self) -> None:
        self.cancel_subscription()
        self._channel.close()
