"""The syncer service: the sans-I/O Syncer core driven by gRPC calls, a timer and durable files.

The core is not thread-safe, so every access goes through one lock (a `threading.Condition`):
gRPC server threads (joins, updates, heartbeats, leaves, ended subscriptions), the timer thread
(which calls `advance(now)` at `next_deadline()` and sleeps on the condition otherwise, woken by any
call that may have moved the deadline) and the status writer. Actions are carried out in order
under the lock: a `Commit` is durable (round log line and merged tensors fsynced) before any `Send`
that follows it is queued, and a `Send` goes to the learner's `Subscription`, whose stream delivers
it. Validation loss is computed in its own thread on a snapshot of the global parameters, so it
never blocks the service.

A learner's subscription stream is its connection: when it ends (the learner died or left), the
learner is treated as gone at once, without waiting for the heartbeat timeout; heartbeats still
catch half-open connections. A learner that comes back subscribes again, which is a join.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco.checkpoint import atomic_write_json
from ddiloco.clock import Clock, MonotonicClock
from ddiloco.data import load_corpus, validation_batches
from ddiloco.messages import (
    Commit,
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
)
from ddiloco.metrics import MetricSink
from ddiloco.model import build_model, estimate_loss
from ddiloco.runtime.run_config import RunConfig
from ddiloco.runtime.syncer_state import Restored, SyncerStore
from ddiloco.syncer import Syncer
from ddiloco.transport.grpc_codec import config_difference
from ddiloco.transport.grpc_server import STOP_GRACE_S, Subscription

logger = logging.getLogger(__name__)

DISCARDED_AT_STOP = "syncer stopped with the round open"
"""Reason of the `discarded` event for each update held in an open round at a clean stop."""
MIN_TIMER_WAIT_S = 1e-3
"""The timer never re-checks sooner than this, so a deadline that `advance` leaves in place (a
learner exactly at its heartbeat timeout) cannot spin the thread."""


@dataclass(frozen=True, kw_only=True)
class SyncerServiceConfig:
    """How the syncer process persists and reports, besides the algorithm."""

    full_state_every_rounds: int = 100
    """Write the full state (model + outer momentum) every this many rounds; every round's merged
    tensors are always written, and a restart replays the rounds after the latest full state."""
    status_every_s: float = 1.0
    """Period of syncer_status.json rewrites."""
    eval_every_s: float = 10.0
    """Period, in seconds of wall time, of the global model's validation loss (0 disables it)."""
    eval_batches: int = 4
    """Validation batches per evaluation."""

    def __post_init__(self) -> None:
        if self.full_state_every_rounds < 1:
            raise ValueError(f"full_state_every_rounds={self.full_state_every_rounds} is invalid: expected >= 1")
        if not self.status_every_s > 0:
            raise ValueError(f"status_every_s={self.status_every_s} is invalid: expected > 0 (seconds)")
        if self.eval_every_s < 0:
            raise ValueError(f"eval_every_s={self.eval_every_s} is invalid: expected >= 0 (seconds, 0 = off)")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches={self.eval_batches} is invalid: expected >= 1")


class SyncerService:
    """Implements `ddiloco.transport.grpc_server.SyncerHandler` around one Syncer core."""

    def __init__(self, run_config: RunConfig, syncer: Syncer, store: SyncerStore, *, sink: MetricSink,
                 config: SyncerServiceConfig | None = None, restored: Restored | None = None,
                 clock: Clock | None = None) -> None:
        self.run_config = run_config
        self.syncer = syncer
        self.store = store
        self.sink = sink
        self.config = config or SyncerServiceConfig()
        self.clock = clock or MonotonicClock()
        self.address = ""
        self.status_path = store.run_dir / "syncer_status.json"
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._closing = False
        self._subscriptions: dict[int, Subscription] = {}
        self._threads: list[threading.Thread] = []
        meta = (restored or Restored()).meta
        self.rejections: Counter[str] = Counter(meta.get("rejections", {}))
        self._rejected = Counter({int(k): v for k, v in meta.get("rejected", {}).items()})
        self._joins = Counter({int(k): v for k, v in meta.get("joins", {}).items()})
        self._bytes_base = (int(meta.get("bytes_received", 0)), int(meta.get("bytes_sent", 0)))
        self._participation = store.participation()
        self._rounds_at_save = syncer.rounds_committed
        self.sends_dropped = 0
        self.val_loss: float | None = meta.get("val_loss")
        self._eval_lock = threading.Lock()
        self._eval_model: torch.nn.Module | None = None
        self._eval_batches: list = []

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self, address: str) -> None:
        self.address = address
        self._threads = [threading.Thread(target=self._timer_loop, name="syncer-timer", daemon=True),
                         threading.Thread(target=self._status_loop, name="syncer-status", daemon=True)]
        if self.config.eval_every_s > 0:
            self._threads.append(threading.Thread(target=self._eval_loop, name="syncer-eval", daemon=True))
        for thread in self._threads:
            thread.start()
        self.write_status()

    def close(self, server=None) -> None:
        """Stop serving: end every subscription, let calls in flight finish (a round being made
        durable completes under the lock), then write the full state, a last validation loss and
        the final status."""
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
            self.store.save(self.syncer, self._meta())
            held = self.syncer.held_updates()
        for update in held:  # open rounds are not durable: these updates are lost with this process
            self.sink.event("discarded", learner_id=update.learner_id, fragment=update.fragment,
                            base_version=update.base_version, inner_step=update.inner_step,
                            reason=DISCARDED_AT_STOP)
        if self.config.eval_every_s > 0:
            self.evaluate()
        self.write_status()
        self.sink.event("stopped", rounds_committed=self.syncer.rounds_committed)
        self.sink.close()

    # ---- the SyncerHandler protocol (gRPC server threads) ---------------------------------------------

    def join(self, join: Join, diloco_config: dict, peer: str) -> Subscription | str | None:
        refusal = self._refusal(join, diloco_config)
        if refusal is not None:
            self._record(join.learner_id, "refused", refusal, peer=peer)
            return refusal
        with self._cond:
            if self._closing:
                return None
            actions = self.syncer.receive(join, self.clock.now())
            refused = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, Refused)]
            if refused:
                reason = refused[0].reason
            else:
                subscription = Subscription(join.learner_id, on_delivered=self._delivered)
                old = self._subscriptions.get(join.learner_id)
                self._subscriptions[join.learner_id] = subscription
                if old is not None:
                    old.close()
                self._joins[join.learner_id] += 1
                self._carry_out(actions)
                self._cond.notify_all()
        if refused:
            self._record(join.learner_id, "refused", reason, peer=peer)
            return reason
        logger.info("[syncer] learner %d joined from %s", join.learner_id, peer)
        self.sink.event("join", learner_id=join.learner_id, peer=peer, joins=self._joins[join.learner_id])
        return subscription

    def _refusal(self, join: Join, diloco_config: dict) -> str | None:
        if join.learner_id >= self.run_config.num_learners:
            return (f"learner_id {join.learner_id} is outside 0..{self.run_config.num_learners - 1}: the run has "
                    f"{self.run_config.num_learners} learners (data shards)")
        difference = config_difference(self.syncer.config, diloco_config)
        if difference is not None:
            return f"algorithm config differs: {difference}"
        model = self.syncer.spec.difference(join.model_spec)
        if model is not None:
            return f"model differs from the syncer's: {model}"
        return None

    def update(self, update: Update) -> tuple[bool, str, str]:
        verdict = (True, "", "")
        with self._cond:
            actions = self.syncer.receive(update, self.clock.now())
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
        self.sink.event("update", learner_id=update.learner_id, fragment=update.fragment,
                        base_version=update.base_version, inner_step=update.inner_step, accepted=accepted,
                        reason=reason)
        if not accepted:
            self._record(update.learner_id, reason, detail, fragment=update.fragment, inner_step=update.inner_step)
        return verdict

    def is_member(self, learner_id: int) -> bool:
        with self._cond:
            info = self.syncer.learners.get(learner_id)
            return learner_id in self._subscriptions and info is not None and info.alive

    def heartbeat(self, heartbeat: Heartbeat) -> bool:
        with self._cond:
            actions = self.syncer.receive(heartbeat, self.clock.now())
            self._cond.notify_all()
        return not any(isinstance(a, Send) and isinstance(a.message, Rejected) for a in actions)

    def leave(self, leave: Leave) -> None:
        with self._cond:
            subscription = self._subscriptions.pop(leave.learner_id, None)
            self._carry_out(self.syncer.receive(leave, self.clock.now()))
            self._cond.notify_all()
        if subscription is not None:
            subscription.close()
        self.sink.event("leave", learner_id=leave.learner_id)

    def subscription_ended(self, subscription: Subscription) -> None:
        with self._cond:
            if self._closing or self._subscriptions.get(subscription.learner_id) is not subscription:
                return  # replaced by a newer subscription of the same learner, or shutting down
            del self._subscriptions[subscription.learner_id]
            self._carry_out(self.syncer.receive(Leave(subscription.learner_id), self.clock.now()))
            self._cond.notify_all()
        logger.warning("[syncer] learner %d disconnected", subscription.learner_id)
        self.sink.event("disconnect", learner_id=subscription.learner_id)

    def record_rejection(self, reason: str, detail: str, *, learner_id: int | None, peer: str,
                         fragment: int | None = None, inner_step: int | None = None) -> None:
        self._record(learner_id, reason, detail, peer=peer, fragment=fragment, inner_step=inner_step)

    def _record(self, learner_id: int | None, reason: str, detail: str, *, peer: str = "",
                fragment: int | None = None, inner_step: int | None = None) -> None:
        with self._cond:
            self.rejections[reason] += 1
            if learner_id is not None:
                self._rejected[learner_id] += 1
        logger.warning("[syncer] rejected %s from learner %s (%s): %s", reason, learner_id, peer or "-", detail)
        self.sink.event("rejection", learner_id=learner_id, reason=reason, detail=detail, peer=peer,
                        fragment=fragment, inner_step=inner_step)

    def _delivered(self, state: FragmentState, seconds: float) -> None:
        with self._cond:
            self.syncer.observe_sync_time(seconds)

    # ---- carrying out actions (lock held) -----------------------------------------------------------------

    def _carry_out(self, actions: list[SyncerAction]) -> None:
        for action in actions:
            if isinstance(action, Commit):
                self.store.commit(action.record)  # durable before any Send that follows
                self._committed(action.record)
            elif isinstance(action, Send):
                subscription = self._subscriptions.get(action.learner_id)
                if subscription is None:
                    self.sends_dropped += 1
                else:
                    subscription.put(action.message)
        if self.syncer.rounds_committed - self._rounds_at_save >= self.config.full_state_every_rounds:
            self.store.save(self.syncer, self._meta())
            self._rounds_at_save = self.syncer.rounds_committed

    def _committed(self, record: RoundRecord) -> None:
        for p in record.participants:
            tally = self._participation.setdefault(p.learner_id, {"accepted": 0, "tokens_merged": 0})
            tally["accepted"] += 1
            tally["tokens_merged"] += p.tokens
        staleness = max(p.staleness for p in record.participants)
        self.sink.log({
            "syncer/rounds_committed": record.round_index + 1,
            f"syncer/fragment/{record.fragment}/version": record.version,
            f"syncer/fragment/{record.fragment}/staleness": staleness,
            "syncer/participants": len(record.participants),
            "syncer/grace_s": record.grace_s,
            "syncer/quorum_wait_s": record.quorum_at - record.opened_at,
        }, step=record.round_index)
        self.sink.event("commit", round=record.round_index, fragment=record.fragment, version=record.version,
                        learners=[p.learner_id for p in record.participants])

    def _meta(self) -> dict[str, Any]:
        received, sent = self._bytes_base
        return {"rejections": dict(self.rejections), "rejected": {str(k): v for k, v in self._rejected.items()},
                "joins": {str(k): v for k, v in self._joins.items()}, "val_loss": self.val_loss,
                "bytes_received": received + self.syncer.bytes_received, "bytes_sent": sent + self.syncer.bytes_sent}

    # ---- threads ---------------------------------------------------------------------------------------------

    def _timer_loop(self) -> None:
        with self._cond:
            while not self._closing:
                now = self.clock.now()
                deadline = self.syncer.next_deadline()
                if deadline is not None and deadline <= now:
                    self._carry_out(self.syncer.advance(now))
                    deadline = self.syncer.next_deadline()
                timeout = None if deadline is None else max(MIN_TIMER_WAIT_S, deadline - self.clock.now())
                self._cond.wait(timeout)

    def _status_loop(self) -> None:
        while not self._stop.wait(self.config.status_every_s):
            self.write_status()

    def _eval_loop(self) -> None:
        while not self._stop.wait(self.config.eval_every_s):
            self.evaluate()

    def evaluate(self) -> float:
        """Validation loss of the current global model (snapshot under the lock, forward outside)."""
        with self._eval_lock:
            if self._eval_model is None:
                self._eval_model = build_model(self.run_config.model)
                self._eval_batches = validation_batches(load_corpus(), self.run_config.data,
                                                        num_batches=self.config.eval_batches)
            with self._cond:
                params = self.syncer.global_params()
                rounds = self.syncer.rounds_committed
            with torch.no_grad():
                for name, param in self._eval_model.named_parameters():
                    param.copy_(params[name])
            loss = estimate_loss(self._eval_model, self._eval_batches)
        self.val_loss = loss
        self.sink.log({"syncer/val_loss": loss, "syncer/rounds_committed": rounds}, step=rounds)
        logger.info("[syncer | round %d] validation loss %.4f", rounds, loss)
        return loss

    def status(self) -> dict[str, Any]:
        with self._cond:
            s = self.syncer
            received, sent = self._bytes_base
            learners = {}
            for learner_id in sorted(set(s.learners) | set(self._participation) | set(self._joins)):
                tally = self._participation.get(learner_id, {})
                info = s.learners.get(learner_id)
                learners[str(learner_id)] = {
                    "accepted": tally.get("accepted", 0), "rejected": self._rejected[learner_id],
                    "tokens_merged": tally.get("tokens_merged", 0), "joins": self._joins[learner_id],
                    "alive": bool(info is not None and info.alive)}
            return {
                "time": time.time(), "pid": os.getpid(), "address": self.address,
                "rounds_committed": s.rounds_committed, "versions": list(s.versions),
                "alive_learners": s.alive_learners(), "min_quorum": s.quorum.min_quorum,
                "effective_quorum": s.effective_quorum(), "grace_s": s.grace_window(),
                "step_time_s": s.step_time.value, "quorum_time_s": s.quorum_time.value,
                "sync_time_s": s.sync_time.value, "rejections": dict(self.rejections),
                "bytes_received": received + s.bytes_received, "bytes_sent": sent + s.bytes_sent,
                "learners": learners, "val_loss": self.val_loss, "sends_dropped": self.sends_dropped,
            }

    def write_status(self) -> None:
        atomic_write_json(self.status_path, self.status(), durable=False)
