"""A learner process's network side: background threads that own the gRPC channel.

The main thread trains and never touches the network. It hands messages to `LearnerIO.send` and
reads what the syncer sent from the `Inbox` between inner steps. Three background threads do the I/O:

- the receiver joins (a `Subscribe` call is the join) and follows the downlink into the inbox; when
  the stream breaks it re-joins with exponential backoff, and a re-join loads the syncer's current
  state (the Welcome), so a learner resumes syncing after a syncer restart without restarting. A new
  run's syncer that has no global model yet answers `no_genesis`: the receiver then proposes the
  learner's initial parameters (`genesis()`, taken while the main thread still waits for its first
  Welcome) and subscribes again. When the syncer does not answer, `ConnectWatch` decides what is
  said (a warning naming the address and the error after a few failed attempts, then at most every
  30 s) and when a learner that has never reached it gives up (`connect_timeout_s`, 0 = never): it
  sets `unreachable` and wakes the main thread. One that has reached it once retries forever;
- the sender uploads queued updates (each held back until its emulated link would have delivered
  it);
- the heartbeat thread sends a heartbeat every `heartbeat_every_s`, whatever the sender does: sent by the sender
  between uploads, none would go out while one upload took longer than the heartbeat timeout (a large update over a
  slow link), and the syncer would time the learner out in the middle of it and refuse its update.

Faults are data: an update that cannot be delivered is dropped and counted (lost work costs only
this learner); a rejection becomes a `Rejected` message for the learner core; a refusal (wrong
token, schema, model or config) becomes a `Refused` message, and the main thread stops. Every queued
update gets exactly one fate, reported through `on_fate(update, fate, reason)` from the sender
thread (or from `close`): accepted, rejected (the syncer's reason), or dropped ("partition", "drop",
"unreachable", or "exit" when it was still queued as the learner stopped).

Injected faults (see `ddiloco.transport.grpc_client`) need one thing from this layer: after a
partition that discarded downlink messages, the first heartbeat that gets through triggers a re-join
(unless the syncer has already forgotten the learner, which asks for one anyway).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ddiloco.backoff import Backoff
from ddiloco.clock import Clock, MonotonicClock
from ddiloco.config import DEFAULT_CONNECT_TIMEOUT_S
from ddiloco.interrupts import SIGNAL_CHECK_S, notify_if_free
from ddiloco.messages import Join, Refused, Rejected, RejectReason, SyncerMessage, Undelivered, Update, Welcome
from ddiloco.transport.genesis_codec import Genesis
from ddiloco.transport.grpc_client import (
    ChaosFault,
    ConnectWatch,
    Fault,
    SyncerClient,
    classify,
    drop_reason,
    error_reason,
    error_text,
)
from ddiloco.transport.grpc_codec import WireError
from ddiloco.transport.grpc_common import ANOTHER_PROCESS

RECONNECT_DELAY_S = (0.1, 2.0)
"""(first, longest) wait between a learner's attempts to subscribe again after its stream to the syncer broke."""
MALFORMED_JOINS_TO_REFUSE = 3
"""Subscriptions in a row the syncer answers INVALID_ARGUMENT (it cannot read this learner's join) after which the
learner stops as refused, with the syncer's words: the same join would be answered the same way for ever."""
MISFIT_WELCOMES_TO_REFUSE = 3
"""Messages from the syncer in a row, with no Welcome read between them, that do not fit this learner's model (other
tensors in a fragment, another fragment count or codec: `MISFITS`), after which the learner stops as refused. Such a
mismatch (the syncer and the learner cut the model into fragments differently: another ddiloco version, another
--fragment-strategy) comes back at every join; the learner re-joined for ever while the run never ended. A message
damaged in flight (`corrupt`, `truncated`) is not one: it is re-joined without a bound."""
MISFITS = frozenset({str(RejectReason.WRONG_TENSORS), str(RejectReason.BAD_FRAGMENT), str(RejectReason.WRONG_CODEC)})

logger = logging.getLogger(__name__)

THREAD_JOIN_S = 5.0
"""How long `close` waits for each I/O thread (they are daemons: a stuck call cannot hang exit)."""
LEAVE_TIMEOUT_S = 2.0


class Inbox:
    """Messages from the syncer, each released at its (emulated) delivery time. Thread-safe."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or MonotonicClock()
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, SyncerMessage]] = []
        self._seq = itertools.count()
        self._woken = False

    def put(self, message: SyncerMessage, deliver_at: float | None = None) -> None:
        with self._cond:
            when = self.clock.now() if deliver_at is None else deliver_at
            heapq.heappush(self._heap, (when, next(self._seq), message))
            self._cond.notify_all()

    def take_ready(self) -> list[SyncerMessage]:
        """Every message whose delivery time has come, in delivery order."""
        return [message for _, message in self.take_ready_at()]

    def take_ready_at(self) -> list[tuple[float, SyncerMessage]]:
        """Every message whose delivery time has come, with that time (on `clock`), in delivery order."""
        now = self.clock.now()
        with self._cond:
            ready = []
            while self._heap and self._heap[0][0] <= now:
                when, _, message = heapq.heappop(self._heap)
                ready.append((when, message))
            return ready

    def wait(self, timeout_s: float | None) -> None:
        """Block until a message is ready, `wake()` is called, or `timeout_s` passes (None: no bound)."""
        deadline = None if timeout_s is None else self.clock.now() + timeout_s
        with self._cond:
            while not self._woken:
                now = self.clock.now()
                if self._heap and self._heap[0][0] <= now:
                    return
                waits = [t - now for t in (deadline, self._heap[0][0] if self._heap else None) if t is not None]
                if waits and min(waits) <= 0:
                    return
                # In slices: the learner's main thread waits here, and runs a signal handler that fell due while
                # another thread received the signal only between two waits (`ddiloco.interrupts`); the handler's
                # wake() ends this loop (the condition's lock is reentrant).
                self._cond.wait(min([*waits, SIGNAL_CHECK_S]))
            self._woken = False

    def wake(self) -> None:
        """End a `wait` now; safe from a signal handler (`ddiloco.interrupts.StopFlag`: it waits for no lock, and a
        waiter it cannot notify at once sees `_woken` within `SIGNAL_CHECK_S`)."""
        self._woken = True
        notify_if_free(self._cond)


@dataclass
class IOStats:
    updates_accepted: int = 0
    """Updates the syncer core took into an open round."""
    updates_rejected: int = 0
    """Updates refused, by the core or on the wire."""
    updates_dropped: int = 0
    """Updates that could not be delivered (syncer unreachable, or an injected partition or drop): that
    work is lost, to this learner only."""
    welcomes: int = 0
    disconnects: int = 0


_STOP = object()

FateCallback = Callable[[Update, str, str], None]
"""(update, fate, reason): fate is "accepted", "rejected" or "dropped"; reason "" when accepted."""


def _ignore_fate(update: Update, fate: str, reason: str) -> None:
    """The default `on_fate`: nobody keeps a ledger."""


class LearnerIO:
    """The two I/O threads of one learner process, around one `SyncerClient`."""

    def __init__(self, client: SyncerClient, join: Join, *, heartbeat_every_s: float,
                 clock: Clock | None = None, on_fate: FateCallback = _ignore_fate,
                 genesis: Callable[[], Genesis] | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """`genesis`: the learner's initial parameters, asked for only if the syncer has none yet (None: this
        learner never proposes them, and waits for another learner to). `connect_timeout_s`: how long the
        receiver tries a syncer that has never answered before it gives up (`ConnectWatch`; 0: forever)."""
        self.client = client
        self.on_fate = on_fate
        self.genesis = genesis
        self.join = join
        self.learner_id = join.learner_id
        self.heartbeat_every_s = heartbeat_every_s
        self.clock = clock or MonotonicClock()
        self.inbox = Inbox(self.clock)
        self.stats = IOStats()
        self.inner_step = 0
        """Set by the main thread; heartbeats report it."""
        self.connected = False
        self.unreachable: str | None = None
        """Set (and the inbox woken) when the receiver gave up on a syncer that never answered: why."""
        self._watch = ConnectWatch(client.address, connect_timeout_s=connect_timeout_s, started_at=self.clock.now())
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._rejoin = threading.Event()
        self._wake_receiver = threading.Event()
        """Set by a stop or a re-join request, so the receiver does not sit out its backoff."""
        self._generation = 0
        self._unknown_reported = -1
        self.failure: BaseException | None = None
        """Set (and the inbox woken) when a background thread failed with an exception it does not handle (a model
        whose values cannot be read, a bug): the main thread raises it (`SessionTransport.take_ready`) rather than
        wait for a Welcome that the dead receiver would never deliver."""
        self._threads = [threading.Thread(target=self._guarded, args=(self._receive_loop,), name="learner-recv",
                                          daemon=True),
                         threading.Thread(target=self._guarded, args=(self._send_loop,), name="learner-send",
                                          daemon=True),
                         threading.Thread(target=self._guarded, args=(self._heartbeat_loop,),
                                          name="learner-heartbeat", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _guarded(self, loop: Callable[[], None]) -> None:
        """Run a background thread's loop; an exception it does not handle is kept for the main thread (`failure`)."""
        try:
            loop()
        except Exception as exc:
            logger.error("[learner %d] the %s thread failed: %s", self.learner_id, threading.current_thread().name,
                         exc, exc_info=True)
            self.failure = exc
            self.inbox.wake()

    def send(self, message: Update | Join) -> None:
        """From the main thread: queue an update, or ask to join again."""
        if isinstance(message, Join):
            self._request_rejoin()
            return
        # The link books the bytes now, so consecutive updates overlap their latencies.
        self._outbox.put((message, self.client.link.send_at(message.payload_bytes)))

    def _request_rejoin(self) -> None:
        self._rejoin.set()
        self._wake_receiver.set()
        self.client.cancel_subscription()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued update has been pushed (or dropped); False on timeout."""
        done = threading.Event()
        self._outbox.put(done)
        return done.wait(timeout_s)

    def close(self, *, leave: bool) -> None:
        if leave:
            try:
                self.client.leave(self.learner_id, timeout_s=LEAVE_TIMEOUT_S)
            except grpc.RpcError as exc:
                logger.info("[learner %d] leave not delivered: %s", self.learner_id, error_text(exc))
        self._stop.set()
        self._wake_receiver.set()
        self._outbox.put(_STOP)
        self.client.cancel_subscription()
        for thread in self._threads:
            if thread.is_alive():  # not when the session's start failed before it started them
                thread.join(THREAD_JOIN_S)
        self.client.close()
        self._drop_queued()

    def _drop_queued(self) -> None:
        """Updates still queued when the learner exits never reach the syncer: their fate is "exit"."""
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                self._dropped(item[0], "exit")

    # ---- receiver ------------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        backoff = Backoff(*RECONNECT_DELAY_S)
        unreadable = 0  # joins in a row the syncer could not read (INVALID_ARGUMENT)
        misfits = 0  # messages in a row that do not fit this learner's model (MISFITS)
        while not self._stop.is_set():
            self._rejoin.clear()
            try:
                for message, deliver_at in self.client.subscribe(self.join):
                    if isinstance(message, Welcome):
                        self._generation += 1
                        self.connected = True
                        self.stats.welcomes += 1
                        self._watch.reached()
                        backoff.reset()
                        unreadable = misfits = 0
                    self.inbox.put(message, deliver_at)
            except ChaosFault as exc:
                logger.info("[learner %d] %s; re-joining", self.learner_id, error_text(exc))
            except grpc.RpcError as exc:
                fault = classify(exc)
                if fault is Fault.REFUSED:
                    self._refused(error_text(exc), error_reason(exc))
                    return
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                unreadable = unreadable + 1 if code == grpc.StatusCode.INVALID_ARGUMENT else 0
                if unreadable >= MALFORMED_JOINS_TO_REFUSE:
                    self._refused(f"the syncer cannot read this learner's join ({error_text(exc)})")
                    return
                if fault is not Fault.TRANSIENT:
                    self._watch.reached()  # an answer, if not a Welcome yet
                if fault is Fault.NO_GENESIS and self.genesis is not None:
                    proposed = self._propose_genesis()
                    if proposed is None:
                        return
                    if proposed:
                        continue
                if not (self._stop.is_set() or self._rejoin.is_set()):
                    if fault is not Fault.TRANSIENT:
                        logger.warning("[learner %d] the syncer at %s answered %s; retrying", self.learner_id,
                                       self.client.address, error_text(exc))
                    elif self._unreachable(error_text(exc)):
                        return
                    else:
                        self._fail_over()
            except WireError as exc:
                self._watch.reached()
                misfits = misfits + 1 if exc.reason in MISFITS else 0
                if misfits >= MISFIT_WELCOMES_TO_REFUSE:
                    self._refused(f"the syncer's messages do not fit this learner's model, {misfits} times in a row "
                                  f"({exc}): the syncer and this learner cut the model into fragments differently; "
                                  "run the same ddiloco version and the same --num-fragments and --fragment-strategy "
                                  "everywhere")
                    return
                logger.error("[learner %d] malformed message from the syncer (%s); re-joining", self.learner_id, exc)
            if self.connected:
                self.stats.disconnects += 1
            self.connected = False
            if not self._rejoin.is_set():
                self._wake_receiver.wait(backoff.next_delay())
            self._wake_receiver.clear()

    def _fail_over(self) -> None:
        """Given several syncer addresses (a syncer and its standbys), try the next one after this one failed."""
        failed = self.client.address
        if self.client.next_address():
            logger.warning("[learner %d] syncer at %s unreachable: trying %s", self.learner_id, failed,
                           self.client.address)

    def _unreachable(self, error: str) -> bool:
        """A subscription that failed without an answer: log it (rate-limited); True when the receiver gives up."""
        verdict = self._watch.failed(self.clock.now(), error)
        if verdict.give_up is not None:
            logger.error("[learner %d] %s", self.learner_id, verdict.give_up)
            self.unreachable = verdict.give_up
            self.inbox.wake()  # the main thread waits for a Welcome that will not come
            return True
        if verdict.warning is not None:
            logger.warning("[learner %d] %s", self.learner_id, verdict.warning)
        else:
            logger.debug("[learner %d] syncer at %s unreachable (%s); retrying", self.learner_id, self.client.address,
                         error)
        return False

    def _propose_genesis(self) -> bool | None:
        """Push the initial parameters; True to subscribe again at once (they, or another learner's, are
        the genesis now), False on a transport fault (retry after the backoff), None when the syncer refused
        them (NaN values, a malformed tensor: the same parameters would be refused again, so the learner stops
        with the syncer's reason instead of retrying for ever)."""
        assert self.genesis is not None
        genesis = self.genesis()
        # Its bytes take the emulated link's time (`--link`), as an update's do (`put`): a slow link is slow from the
        # first transfer on.
        deliver_at = self.client.link.send_at(sum(t.numel() * t.element_size() for t in genesis.tensors.values()))
        if self._stop.wait(max(0.0, deliver_at - self.clock.now())):
            return False
        try:
            accepted = self.client.push_genesis(genesis)
        except grpc.RpcError as exc:
            if classify(exc) in (Fault.REFUSED, Fault.REJECTED):
                self._refused(f"the initial parameters ({error_text(exc)})")
                return None
            logger.warning("[learner %d] genesis not delivered (%s); retrying", self.learner_id, error_text(exc))
            return False
        logger.info("[learner %d] %s", self.learner_id, "its initial parameters are the run's genesis" if accepted
                    else "the run already has a genesis")
        return True

    def _refused(self, text: str, reason: str | None = None) -> None:
        """`reason`: the wire's reason of the refusal (`ddiloco-reason`), when it has one."""
        logger.debug("[learner %d] refused by the syncer: %s", self.learner_id, text)  # the session says it, once
        self.inbox.put(Refused(self.learner_id, text, another_process=reason == ANOTHER_PROCESS))

    # ---- sender ---------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            item = self._outbox.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            update, deliver_at = item
            if self._stop.wait(max(0.0, deliver_at - self.clock.now())):
                self._dropped(update, "exit")
                return
            self._push(update)

    def _push(self, update: Update) -> None:
        generation = self._generation
        try:
            reply = self.client.push(self.client.encode_update(update))
        except grpc.RpcError as exc:
            fault = classify(exc)
            if fault is Fault.REFUSED:
                self.stats.updates_rejected += 1
                self.on_fate(update, "rejected", error_reason(exc) or "refused")
                self._refused(error_text(exc), error_reason(exc))
            elif fault is Fault.REJECTED:
                self.stats.updates_rejected += 1
                self.on_fate(update, "rejected", error_reason(exc) or str(RejectReason.MALFORMED))
                self._rejected(update, error_reason(exc), error_text(exc), generation)
            else:
                logger.info("[learner %d] update for fragment %d dropped: %s", self.learner_id, update.fragment,
                            error_text(exc))
                self._dropped(update, drop_reason(exc))
            return
        if reply.accepted:
            self.stats.updates_accepted += 1
            self.on_fate(update, "accepted", "")
        else:
            self.stats.updates_rejected += 1
            self.on_fate(update, "rejected", reply.reason)
            self._rejected(update, reply.reason, reply.detail, generation)

    def _dropped(self, update: Update, reason: str) -> None:
        self.stats.updates_dropped += 1
        self.on_fate(update, "dropped", reason)
        # The training thread stops waiting for its result (`Learner._undelivered`), and wakes if it waits now.
        self.inbox.put(Undelivered(self.learner_id, update.fragment, update.base_version, update.inner_step))

    def _rejected(self, update: Update, reason: str, detail: str, generation: int) -> None:
        try:
            why = RejectReason(reason)
        except ValueError:
            why = RejectReason.MALFORMED  # a wire-level reason (oversize, truncated): the update was bad
        if why is RejectReason.UNKNOWN_LEARNER and not self._first_unknown(generation):
            return
        self.inbox.put(Rejected(self.learner_id, update.fragment, update.base_version, why, detail,
                                inner_step=update.inner_step))

    def _first_unknown(self, generation: int) -> bool:
        # "Unknown learner" asks the core to join again; once per joined session is enough, and an
        # answer to a call made before the latest Welcome is already out of date.
        if generation != self._generation or self._unknown_reported == generation:
            return False
        self._unknown_reported = generation
        return True

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_every_s):
            self._heartbeat()

    def _heartbeat(self) -> None:
        generation = self._generation
        try:
            known = self.client.heartbeat(self.learner_id, self.inner_step)
        except grpc.RpcError as exc:
            if classify(exc) is Fault.REFUSED:
                self._refused(error_text(exc), error_reason(exc))
            return
        missed = self.client.take_downlink_missed()
        if not known and self.connected and self._first_unknown(generation):
            self.inbox.put(Rejected(self.learner_id, -1, -1, RejectReason.UNKNOWN_LEARNER, "heartbeat"))
        elif known and missed:
            logger.info("[learner %d] the partition discarded messages from the syncer; re-joining", self.learner_id)
            self._request_rejoin()
