"""The syncer service: the sans-I/O Syncer core driven by gRPC calls, a timer and durable files.

The core is not thread-safe, so every access goes through one lock (a `threading.Condition`):
gRPC server threads (joins, updates, heartbeats, leaves, ended subscriptions), the timer thread
(which calls `advance(now)` at `next_deadline()` and sleeps on the condition otherwise, woken by any
call that may have moved the deadline) and the status writer. Actions are carried out in order
under the lock. The store is the core's journal: a round is durable (merged tensors and round log line
fsynced) before the core changes any state for it, so a `Commit` action is already durable when the
`Send`s that follow it are queued; a `Send` goes to the learner's `Subscription`, whose stream delivers
it. When the disk is full, the core refuses updates as `unavailable` and retries (`Syncer.storage_error`,
shown in the status); status, metrics and full states are written when they can be (`WriteTrouble`).

The service knows the model only as named tensors. A new run has no Syncer core until its genesis: the first
learner that joins either gets the parameters of the `--init` file or is asked for its own (`no_genesis`, then
`genesis`). The genesis is written durably once (`write_genesis`) before any Welcome; later and restarted learners
are checked against it like any joiner. Evaluation is not done here: an evaluator is a read-only subscriber
(`snapshot`, the Watch call) running the user's function. Which joins are refused before the core sees them, and
the genesis an --init file gives, are `syncer_admission`'s rules; the counters, `syncer_status.json` and the round
metrics are `syncer_tally`'s.

A learner's subscription stream is its connection: when it ends (the learner died or left), the
learner is treated as gone at once, without waiting for the heartbeat timeout; heartbeats still
catch half-open connections. A learner that comes back subscribes again, which is a join.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco.checkpoint import WriteTrouble, atomic_write_json, read_json_object
from ddiloco.clock import Clock, MonotonicClock
from ddiloco.messages import (
    Commit,
    FragmentDelta,
    FragmentState,
    Heartbeat,
    Join,
    Leave,
    Refused,
    Rejected,
    RoundRecord,
    Send,
    SyncerAction,
    Update,
    Welcome,
)
from ddiloco.metrics import MetricSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_admission import (
    duplicate_process,
    genesis_for_join,
    join_refusal,
    replaced_process,
    watch_refusal,
)
from ddiloco.runtime.syncer_state import GenesisRecord, Restored, SyncerStore, write_genesis
from ddiloco.runtime.syncer_tally import SyncerTally, round_metrics
from ddiloco.syncer import Syncer
from ddiloco.transport.genesis_codec import Genesis
from ddiloco.transport.grpc_codec import WireModel, shortened
from ddiloco.transport.grpc_common import ANOTHER_PROCESS, NO_GENESIS
from ddiloco.transport.grpc_server import STOP_GRACE_S
from ddiloco.transport.subscription import Subscription
from ddiloco.transport.syncer_handler import STOPPED, AnotherProcess, peer_host

logger = logging.getLogger(__name__)

DISCARDED_AT_STOP = "syncer stopped with the round open"
"""Reason of the `discarded` event for each update held in an open round at a clean stop."""
MIN_TIMER_WAIT_S = 1e-3
"""The timer never re-checks sooner than this, so a deadline that `advance` leaves in place (a
learner exactly at its heartbeat timeout) cannot spin the thread."""
TIMER_TICK_S = 0.5
"""The timer wakes at least this often, to measure the syncer's own pauses (`PAUSE_S`)."""
PAUSE_S = 1.0
"""A timer wake-up later than asked by more than this is a pause of the syncer (its process stopped, its machine
suspended, the lock held by a long merge): learners could not be heard meanwhile, and `Syncer.paused` does not count
it as their silence. After a 40 s SIGSTOP of the syncer every learner was timed out at once."""
EXIT_CORE_FAULT = 70
"""The syncer process's exit status when its core raised (`SyncerService._core`): restarted like any crash."""


@dataclass(frozen=True, kw_only=True)
class SyncerServiceConfig:
    """How the syncer process persists and reports, besides the algorithm."""

    full_state_every_rounds: int = 100
    """Write the full state (model + outer momentum) every this many rounds; every round's merged
    tensors are always written, and a restart replays the rounds after the latest full state."""
    status_every_s: float = 1.0
    """Period of syncer_status.json rewrites."""
    refusal_log_period_s: float = 10.0
    """Refused calls other than rejected updates (a wrong token, a malformed join, ...) are logged, and written as
    `rejection` events, once per reason and peer host in this many seconds; the rest of the period is one
    `rejections_suppressed` summary. syncer_status.json counts every one."""

    def __post_init__(self) -> None:
        if self.full_state_every_rounds < 1:
            raise ValueError(f"full_state_every_rounds={self.full_state_every_rounds} is invalid: expected >= 1")
        if not self.status_every_s > 0:
            raise ValueError(f"status_every_s={self.status_every_s} is invalid: expected > 0 (seconds)")
        if not self.refusal_log_period_s > 0:
            raise ValueError(f"refusal_log_period_s={self.refusal_log_period_s} is invalid: expected > 0 (seconds)")


class SyncerService:
    """Implements `ddiloco.transport.syncer_handler.SyncerHandler` around one Syncer core."""

    def __init__(self, run_config: RunConfig, syncer: Syncer | None, store: SyncerStore, *, sink: MetricSink,
                 config: SyncerServiceConfig | None = None, restored: Restored | None = None,
                 clock: Clock | None = None, init: dict[str, torch.Tensor] | None = None,
                 init_source: str = "") -> None:
        """`syncer`: the core, restored from the run directory; None for a new run that has no genesis yet,
        which it then takes from `init` (an --init file's tensors) or from the first learner."""
        self.run_config = run_config
        self.syncer: Syncer | None = None
        self._wire: WireModel | None = None
        self._init = init
        self._init_source = init_source
        self.store = store
        self.sink = sink
        self.config = config or SyncerServiceConfig()
        self.clock = clock or MonotonicClock()
        self.address = ""
        self.status_path = store.run_dir / "syncer_status.json"
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._closing = False
        self._timer_due_at: float | None = None
        """When the timer last ran, or when its current wait is to end (None before it first runs): a core call or a
        timer step later than that by more than PAUSE_S, from whichever thread, finds a pause of the syncer's own
        (`_note_pause`)."""
        self._subscriptions: dict[int, Subscription] = {}
        self._threads: list[threading.Thread] = []
        self.tally = SyncerTally((restored or Restored()).meta,
                                 store.participation(syncer.fragment_shares) if syncer is not None else {},
                                 num_learners=run_config.num_learners,
                                 refusal_log_period_s=self.config.refusal_log_period_s)
        self.tally.carry_over(read_json_object(self.status_path) or {})  # the run's previous syncer process's
        self._rounds_at_save = 0
        self._arriving: Update | None = None
        self._arrival_logged = False
        self.sends_dropped = 0
        self._state_writes = WriteTrouble(f"the syncer's full state in {store.state_dir}")
        self._status_writes = WriteTrouble(str(self.status_path))
        if syncer is not None:
            self._adopt(syncer)
            # The next full state comes full_state_every_rounds after the newest one on disk, not after this process's
            # start: a syncer restarted every few dozen rounds would otherwise never write one, and each restart would
            # replay every round since the last (`tests/unit/test_restart_full_state.py`).
            self._rounds_at_save = (restored or Restored()).state_rounds

    def _adopt(self, syncer: Syncer) -> None:
        syncer.journal = self  # every round durable in the run directory (`commit`) before the core changes state
        self.syncer = syncer
        self._wire = WireModel(syncer.spec, syncer.plan, self.run_config.diloco.codec,
                               self.run_config.diloco.downlink_codec)
        self._rounds_at_save = syncer.rounds_committed

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self, address: str) -> None:
        self.address = address
        self._threads = [threading.Thread(target=self._timer_loop, name="syncer-timer", daemon=True),
                         threading.Thread(target=self._status_loop, name="syncer-status", daemon=True)]
        for thread in self._threads:
            thread.start()
        self.write_status()

    def close(self, server=None) -> None:
        """Stop serving: end every subscription, let calls in flight finish (a round being made
        durable completes under the lock), then write the full state and the final status."""
        with self._cond:
            self._closing = True
            subscriptions = list(self._subscriptions.values())
            self._subscriptions.clear()
            self._cond.notify_all()
        self._stop.set()
        for subscription in subscriptions:
            subscription.close()
        if server is not None:
            server.stop(STOP_GRACE_S).wait()
        for thread in self._threads:
            thread.join()
        with self._cond:
            held = []
            if self.syncer is not None:
                self._save_state()
                held = self.syncer.held_updates()
        for update in held:  # open rounds are not durable: these updates are lost with this process
            self.sink.event("discarded", learner_id=update.learner_id, fragment=update.fragment,
                            base_version=update.base_version, inner_step=update.inner_step,
                            reason=DISCARDED_AT_STOP)
        self._summarise_refusals(final=True)
        self.write_status()
        self.sink.event("stopped", rounds_committed=self.rounds_committed)
        self.sink.close()

    # ---- the SyncerHandler protocol (gRPC server threads) ---------------------------------------------

    @property
    def rounds_committed(self) -> int:
        return self.syncer.rounds_committed if self.syncer is not None else 0

    @property
    def rejections(self) -> Counter[str]:
        """Refusals by reason, since the run began (`syncer_status.json` `rejections`)."""
        return self.tally.rejections

    def wire_model(self) -> WireModel | None:
        return self._wire

    def join(self, join: Join, diloco_config: dict, peer: str, session: str = "") -> Subscription | str | None:
        """`session`: which process joins (the client's host/pid/random), to refuse a second live process with the
        same learner id while the same process may join again."""
        refusal = join_refusal(self.run_config, self.syncer, join, diloco_config)
        if refusal is not None:
            self._record(join.learner_id, "refused", refusal, peer=peer)
            return refusal
        with self._cond:
            if self._closing:
                return None
            reason = duplicate_process(self.run_config, self.syncer, join.learner_id, session,
                                       old=self._subscriptions.get(join.learner_id), clock=self.clock)
            if reason is None and self.syncer is None:  # a new run's first join
                made = genesis_for_join(join, self._init, self._init_source)
                reason = made if isinstance(made, str) else self._establish(made)
            if reason is NO_GENESIS:
                return NO_GENESIS
            refused = reason is not None
            if not refused:
                assert self.syncer is not None
                actions = self._core(self.syncer.receive, join)
                refusals = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, Refused)]
                refused, reason = bool(refusals), (refusals[0].reason if refusals else None)
            if not refused:
                subscription = Subscription(join.learner_id, on_delivered=self._delivered, newest=self._newest,
                                            session=session, peer=peer, since=self.clock.now())
                old = self._subscriptions.get(join.learner_id)
                self._subscriptions[join.learner_id] = subscription
                if old is not None:
                    old.close()
                self.tally.joins[join.learner_id] += 1
                self._carry_out(actions)
                self._cond.notify_all()
        if refused:
            self._record(join.learner_id, ANOTHER_PROCESS if isinstance(reason, AnotherProcess) else "refused", reason,
                         peer=peer)
            return reason
        logger.info("[syncer] learner %d joined from %s", join.learner_id, peer)
        self.sink.event("join", learner_id=join.learner_id, peer=peer, joins=self.tally.joins[join.learner_id])
        return subscription

    def genesis(self, genesis: Genesis, peer: str) -> tuple[bool, str]:
        """A learner's initial parameters, proposed after a `no_genesis` answer: the first one wins."""
        with self._cond:
            if self._closing:
                return False, "the syncer is shutting down"
            if self.syncer is not None:
                return False, "the run already has its genesis"
            if self._init is not None:
                return False, "the run's genesis comes from its --init file"
            if genesis.learner_id >= self.run_config.num_learners:
                return False, f"learner_id {genesis.learner_id} is outside 0..{self.run_config.num_learners - 1}"
            trouble = self._establish(GenesisRecord(dict(genesis.tensors), genesis.embeddings,
                                                    f"learner {genesis.learner_id} ({peer})", genesis.aliases))
        return trouble is None, trouble or ""

    def _establish(self, genesis: GenesisRecord) -> str | None:
        """Make `genesis` the run's origin (lock held): durable first, then the core, then its first full state
        (which a restart could do without: it replays the round log from the genesis). Why it cannot be written,
        or None."""
        try:
            write_genesis(self.store.run_dir, genesis)
        except OSError as exc:  # nothing is written: the next joiner tries again
            logger.error("[syncer] cannot write the run's genesis: %s", exc)
            return f"the syncer cannot write the run's genesis ({exc}): try again later"
        self._adopt(genesis.syncer(self.run_config.diloco, self.run_config.quorum))
        self._save_state()
        count = sum(t.numel() for t in genesis.params.values())
        logger.warning("[syncer] genesis: %d parameters in %d tensors from %s", count, len(genesis.params),
                       genesis.source)
        self.sink.event("genesis", source=genesis.source, parameters=count, tensors=len(genesis.params),
                        embeddings=list(genesis.embeddings))
        self._cond.notify_all()
        return None

    def snapshot(self, after_round: int, not_before: float) -> tuple[int, Welcome] | str | None:
        """For a read-only subscriber, without waiting: once more than `after_round` rounds have committed (or
        at once, with -1, as soon as there is a genesis) and not before monotonic time `not_before`, (rounds
        committed, the whole global model as a Welcome); None while not; STOPPED when the syncer stops."""
        with self._cond:
            if self._closing:
                return STOPPED
            ready = self.syncer is not None and self.syncer.rounds_committed > after_round
            if not ready or self.clock.now() < not_before:
                return None
            states = tuple(self.syncer.fragment_state(p) for p in range(self.syncer.plan.num_fragments))
            self.tally.bytes_watched += sum(state.payload_bytes for state in states)
            return self.syncer.rounds_committed, Welcome(0, states, self.syncer.config.fingerprint())

    def update(self, update: Update) -> tuple[bool, str, str]:
        verdict = (True, "", "")
        with self._cond:
            assert self.syncer is not None, "the wire layer refuses updates before the genesis"
            self._arriving, self._arrival_logged = update, False
            try:
                actions = self._core(self.syncer.receive, update)
            finally:
                self._arriving = None
            logged = self._arrival_logged  # read under the lock: another update may start as soon as it is free
            rest: list[SyncerAction] = []
            for action in actions:
                message = action.message if isinstance(action, Send) else None
                if isinstance(message, Rejected) and action.learner_id == update.learner_id:
                    verdict = (False, str(message.reason), message.detail)  # travels in the reply
                else:
                    rest.append(action)
            self._carry_out(rest)
            self._cond.notify_all()
        accepted, reason, detail = verdict
        if not logged:
            self._log_update(update, accepted=accepted, reason=reason)
        if not accepted:
            self._record(update.learner_id, reason, detail, fragment=update.fragment, inner_step=update.inner_step)
        return verdict

    def commit(self, record: RoundRecord) -> None:
        """The core's journal: the round made durable in the run directory. The update that closed it is logged
        as accepted at once after the fsync, not after the round's results went out, so that a kill -9 of the
        syncer leaves at most the last round's closing update merged without its line (the chaos invariant
        every_update_merged_or_rejected_with_reason allows exactly that, as it allows the last commit line)."""
        self.store.commit(record)
        update = self._arriving
        if update is not None and not self._arrival_logged and record.fragment == update.fragment and any(
                p.learner_id == update.learner_id and p.base_version == update.base_version
                and p.inner_step == update.inner_step for p in record.participants):
            self._log_update(update, accepted=True, reason="")
            self._arrival_logged = True

    def _log_update(self, update: Update, *, accepted: bool, reason: str) -> None:
        self.sink.event("update", learner_id=update.learner_id, fragment=update.fragment,
                        base_version=update.base_version, inner_step=update.inner_step, accepted=accepted,
                        reason=reason)

    def is_member(self, learner_id: int) -> bool:
        with self._cond:
            info = self.syncer.learners.get(learner_id) if self.syncer is not None else None
            return learner_id in self._subscriptions and info is not None and info.alive

    def watch_refusal(self, declared: dict | None) -> str | None:
        return watch_refusal(self.run_config, declared)  # the run config never changes: no lock

    def replaced(self, learner_id: int, session: str) -> str | None:
        with self._cond:
            return replaced_process(learner_id, session, holder=self._subscriptions.get(learner_id), clock=self.clock)

    def heartbeat(self, heartbeat: Heartbeat) -> bool:
        with self._cond:
            if self.syncer is None:
                return False
            actions = self._core(self.syncer.receive, heartbeat)
            self._cond.notify_all()
        return not any(isinstance(a, Send) and isinstance(a.message, Rejected) for a in actions)

    def leave(self, leave: Leave) -> None:
        with self._cond:
            subscription = self._subscriptions.pop(leave.learner_id, None)
            if self.syncer is not None:
                self._carry_out(self._core(self.syncer.receive, leave))
            self._cond.notify_all()
        if subscription is not None:
            subscription.close()
        self.sink.event("leave", learner_id=leave.learner_id)

    def subscription_ended(self, subscription: Subscription) -> None:
        with self._cond:
            if self._closing or self._subscriptions.get(subscription.learner_id) is not subscription:
                return  # replaced by a newer subscription of the same learner, or shutting down
            del self._subscriptions[subscription.learner_id]
            self._carry_out(self._core(self.syncer.receive, Leave(subscription.learner_id)))
            self._cond.notify_all()
        logger.warning("[syncer] learner %d disconnected", subscription.learner_id)
        self.sink.event("disconnect", learner_id=subscription.learner_id)

    def record_rejection(self, reason: str, detail: str, *, learner_id: int | None, peer: str,
                         fragment: int | None = None, inner_step: int | None = None) -> None:
        self._record(learner_id, reason, detail, peer=peer, fragment=fragment, inner_step=inner_step)

    def _record(self, learner_id: int | None, reason: str, detail: str, *, peer: str = "",
                fragment: int | None = None, inner_step: int | None = None) -> None:
        # An update's rejection is its fate, which the event log holds one by one (the chaos invariants match every
        # publish to one); any other refusal can come from anyone who reaches the port, as fast as they can call.
        throttled, detail = fragment is None, shortened(detail)
        with self._cond:
            self.tally.count_rejection(reason, learner_id)
            if throttled and not self.tally.refusals.admit((reason, peer_host(peer)), self.clock.now()):
                return  # counted; summed up by _summarise_refusals
        more = (f" (more from {peer_host(peer) or '-'} are summed up every {self.config.refusal_log_period_s:g} s)"
                if throttled else "")
        # Before its token is checked a call is nobody's: "from learner None" read as a learner's id.
        who = f"learner {learner_id}" if learner_id is not None else "a caller"
        logger.warning("[syncer] rejected %s from %s (%s): %s%s", reason, who, peer or "-", detail, more)
        self.sink.event("rejection", learner_id=learner_id, reason=reason, detail=detail, peer=peer,
                        fragment=fragment, inner_step=inner_step)

    def _newest(self, fragment: int) -> FragmentState:
        """The fragment's current state, for a subscriber too far behind to be sent each change."""
        with self._cond:
            return self.syncer.fragment_state(fragment)

    def _summarise_refusals(self, *, final: bool = False) -> None:
        """Once a period is over (and at the stop): one log line and one `rejections_suppressed` event per reason and
        peer host for the refusals `_record` counted without logging them."""
        with self._cond:
            counted = self.tally.refusals.drain(self.clock.now(), final=final)
        for (reason, peer), count in sorted(counted.items()):
            logger.warning("[syncer] rejected %s from %s %d more times this period (%g s)", reason, peer or "-",
                           count, self.config.refusal_log_period_s)
            self.sink.event("rejections_suppressed", reason=reason, peer=peer, count=count)

    def _delivered(self, state: FragmentState | FragmentDelta, seconds: float) -> None:
        with self._cond:
            if self.syncer is not None:
                self.syncer.observe_sync_time(seconds)

    # ---- the core (lock held) --------------------------------------------------------------------------------

    def _core(self, call: Callable[[Any, float], list[SyncerAction]], message: Any) -> list[SyncerAction]:
        """`call(message, now)` on the core. The core refuses bad input with actions and never raises on it: an
        exception is a fault of the core's own, after which its state in memory cannot be trusted (it may have made
        a round durable and not yet sent it). Left so, a gRPC call failed and a dead timer thread stalled the run.
        The process ends instead, with EXIT_CORE_FAULT, and the supervisor restarts it from its durable state (the
        round log is replayed bit for bit); the learners reconnect by themselves."""
        try:
            now = self.clock.now()
            self._note_pause(now)
            return call(message, now)
        except Exception:
            logger.critical("[syncer] the syncer core failed on %s: ending the process, to restart from its durable "
                            "state", type(message).__name__ if message is not None else "its timer", exc_info=True)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_CORE_FAULT)

    def _note_pause(self, now: float) -> None:
        """A syncer that did not run for longer than PAUSE_S past its timer's due time (its process stopped, its machine
        suspended, the lock held by a long merge) tells its core, once, before the core hears or times anything: the
        learners could not be heard meanwhile. Every core call and each step of the timer looks, so a stop is found
        wherever it fell: were only the timer's wake-up to look, a stop while the timer was advancing the core would go
        unseen (its next wait is set from the time after the stop), and its next advance would time every learner out (a
        CI run of tests/integration/test_syncer_pause.py). Lock held."""
        due_at = self._timer_due_at
        if self.syncer is not None and due_at is not None and now - due_at > PAUSE_S:
            logger.warning("[syncer] paused for %.1f s (its process was stopped or its machine suspended?): "
                           "not counted as the learners' silence", now - due_at)
            self.syncer.paused(now - due_at)
            self._timer_due_at = now

    # ---- carrying out actions (lock held) -----------------------------------------------------------------

    def _carry_out(self, actions: list[SyncerAction]) -> None:
        assert self.syncer is not None, "actions come from the core"
        for action in actions:
            if isinstance(action, Commit):
                self._committed(action.record, action.capped)  # already durable: the core's journal is the store
            elif isinstance(action, Send):
                subscription = self._subscriptions.get(action.learner_id)
                if subscription is None:
                    self.sends_dropped += 1
                else:
                    subscription.put(action.message)
        if self.syncer.rounds_committed - self._rounds_at_save >= self.config.full_state_every_rounds:
            self._save_state()

    def _save_state(self) -> None:
        """A full state (lock held). It only shortens a restart's replay, so a write that fails (a full disk)
        is logged and tried again after the next round; the round log alone restores every round."""
        if self._state_writes.attempt(lambda: self.store.save(self.syncer, self.tally.meta(self.syncer))):
            self._rounds_at_save = self.syncer.rounds_committed

    def _committed(self, record: RoundRecord, capped: Sequence[int]) -> None:
        assert self.syncer is not None, "commits come from the core"
        self.tally.count_commit(record, self.syncer.fragment_shares, capped=capped)
        # At the rounds committed with it, the evaluator's step for the model it measures after them: the same model at
        # one step in TensorBoard (the round's 0-based index put the syncer's a step before the evaluator's).
        self.sink.log(round_metrics(record), step=record.round_index + 1)
        self.sink.event("commit", round=record.round_index, fragment=record.fragment, version=record.version,
                        learners=[p.learner_id for p in record.participants])

    # ---- threads ---------------------------------------------------------------------------------------------

    def _timer_loop(self) -> None:
        with self._cond:
            while not self._closing:
                if self.syncer is None:
                    self._cond.wait()  # woken by the genesis (or the stop)
                    continue
                now = self.clock.now()
                self._note_pause(now)
                self._timer_due_at = now  # running: a stop from here on is measured from now
                deadline = self.syncer.next_deadline()
                if deadline is not None and deadline <= now:
                    self._carry_out(self._core(lambda _, at: self.syncer.advance(at), None))
                    deadline = self.syncer.next_deadline()
                now = self.clock.now()
                self._note_pause(now)  # a stop while it advanced: before the next due time hides it
                timeout = TIMER_TICK_S if deadline is None else min(TIMER_TICK_S, max(MIN_TIMER_WAIT_S, deadline - now))
                self._timer_due_at = now + timeout
                self._cond.wait(timeout)

    def _status_loop(self) -> None:
        while not self._stop.wait(self.config.status_every_s):
            self.write_status()
            self._summarise_refusals()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return self.tally.status(self.syncer, address=self.address, min_quorum=self.run_config.quorum.min_quorum,
                                     sends_dropped=self.sends_dropped)

    def write_status(self) -> None:
        status = self.status()
        self._status_writes.attempt(lambda: atomic_write_json(self.status_path, status, durable=False))
