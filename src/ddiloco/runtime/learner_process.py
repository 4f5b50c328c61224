"""One learner process: the Learner core, the inner steps, local checkpoints and status.

The main thread trains with `ddiloco.training.inner_step` (the project's one inner-step body) on its
own data shard and does no network I/O: between inner steps it applies what the I/O threads
(`LearnerIO`) put in the inbox, and it hands them the updates that fall due. When the waiting rule
blocks (`Learner.can_step` is False) it waits on the inbox, for at most `LearnerConfig.max_wait_s`,
and then calls `stop_waiting()` and trains on. When the syncer is unreachable it keeps training
within that bound while the I/O threads reconnect.

Every `checkpoint_every_s` (and on stop) it saves its own progress (inner step, schedule position,
AdamW state, data cursor, counters) under `learners/N/checkpoint/`, written by a background thread
from a snapshot; not the model, whose parameters come from the syncer at every (re)join. A restarted
learner resumes from there, or from scratch with a fresh optimizer when there is none.

It always keeps a work ledger, `learners/N/work.jsonl` (`WorkLedger`): what it published, what
became of each update, what it received, and how much unpublished work each Welcome or the end of
the process threw away, so a chaos run can account for every inner step (docs/runtime.md). A
`slowdown` factor above 1 (a straggler injected by a chaos run) stretches every inner step to that
many times its compute time.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import atomic_write_json, load_latest_state, save_state
from ddiloco.clock import MonotonicClock
from ddiloco.data import load_corpus, shard_stream
from ddiloco.learner import Learner, next_uncommitted_round
from ddiloco.messages import FragmentState, Refused, Update, Welcome
from ddiloco.metrics import MetricSink
from ddiloco.model import build_model
from ddiloco.run_config import RunConfig
from ddiloco.training import inner_step, make_inner_optimizer
from ddiloco.transport.grpc_client import SyncerClient
from ddiloco.transport.grpc_codec import WireModel
from ddiloco.transport.learner_io import LearnerIO
from ddiloco.work_ledger import WorkLedger, fragment_shares, last_logged_step

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_REFUSED = 3
STOP_FLUSH_S = 1.0
"""On SIGTERM, how long queued updates may take to go out before the learner leaves."""
COUNTERS = ("updates_sent", "updates_accepted", "updates_rejected", "updates_dropped", "fragments_applied",
            "bytes_sent", "bytes_received", "joins", "waits_abandoned")
"""Counters reported in status.json, carried across restarts by the checkpoint."""


@dataclass(frozen=True, kw_only=True)
class LearnerProcessConfig:
    """Where and how one learner process runs (the algorithm lives in the RunConfig)."""

    learner_id: int
    run_dir: Path
    device: str = "cpu"
    """torch device of the model: cpu, cuda, cuda:1, ..."""
    checkpoint_every_s: float = 10.0
    """Period of local checkpoints; a learner killed hard redoes at most this much work."""
    status_every_s: float = 1.0
    """Period of status.json rewrites."""
    flush_timeout_s: float = 5.0
    """At the end, how long queued updates may take to reach the syncer before the learner leaves."""

    def __post_init__(self) -> None:
        if self.learner_id < 0:
            raise ValueError(f"learner_id={self.learner_id} is invalid: expected an integer >= 0")
        for name in ("checkpoint_every_s", "status_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected > 0 (seconds)")
        if self.flush_timeout_s < 0:
            raise ValueError(f"flush_timeout_s={self.flush_timeout_s} is invalid: expected >= 0 (seconds)")

    @property
    def directory(self) -> Path:
        return self.run_dir / "learners" / str(self.learner_id)


def no_slowdown() -> float:
    """The default `slowdown`: every inner step at full speed."""
    return 1.0


@dataclass
class _Progress:
    """What the status thread reads; replaced (not mutated) by the main thread."""

    state: str = "joining"
    inner_step: int = 0
    loss: float | None = None
    tokens: int = 0
    versions: list[int] = field(default_factory=list)


class LearnerProcess:
    """Runs one learner until it has trained `inner_steps` inner steps. See the module docstring."""

    def __init__(self, run_config: RunConfig, config: LearnerProcessConfig,
                 connect: Callable[[WireModel], SyncerClient], *, sink: MetricSink,
                 slowdown: Callable[[], float] = no_slowdown) -> None:
        if config.learner_id >= run_config.num_learners:
            raise ValueError(f"learner_id={config.learner_id} is invalid: the run has {run_config.num_learners} "
                             f"learners (ids 0..{run_config.num_learners - 1})")
        self.run_config = run_config
        self.config = config
        self.sink = sink
        self.clock = MonotonicClock()
        self.prefix = f"learner/{config.learner_id}"
        self._stop = threading.Event()
        self._status_stop = threading.Event()
        self.model = build_model(run_config.model).to(config.device)
        self.optimizer = make_inner_optimizer(self.model, run_config.inner)
        self.learner = Learner(run_config.diloco, learner_id=config.learner_id, model=self.model,
                               optimizer=self.optimizer)
        self.stream = shard_stream(load_corpus(), run_config.data, shard=config.learner_id,
                                   num_shards=run_config.num_learners)
        self.slowdown = slowdown
        self.client = connect(WireModel(self.learner.spec, self.learner.plan, run_config.diloco.codec))
        self.ledger: WorkLedger | None = None
        """Opened in `run`, once the checkpoint has told the inner step this incarnation starts from."""
        self.io = LearnerIO(self.client, self.learner.join_message(),
                            heartbeat_every_s=run_config.learner.heartbeat_every_s, clock=self.clock,
                            on_fate=self._fate)
        self.base: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.progress = _Progress()
        self.refusal: str | None = None
        self._synchronous = run_config.quorum.min_quorum >= run_config.num_learners > 1
        """K = M: every round waits for every live learner, so a fresh incarnation takes the global schedule
        position at its first Welcome (`Learner.take_schedule_position`)."""
        self._positioned = False
        self._status_thread = threading.Thread(target=self._status_loop, name="learner-status", daemon=True)
        self._saver: threading.Thread | None = None
        self._last_rate = (time.monotonic(), 0)
        self.tokens_per_s = 0.0

    @property
    def checkpoint_dir(self) -> Path:
        return self.config.directory / "checkpoint"

    def request_stop(self) -> None:
        """Safe from a signal handler: the main thread stops after its current inner step."""
        self._stop.set()
        # The inbox's condition may be held by this very thread when the signal arrives; wake it
        # from another thread so the handler never blocks on it.
        threading.Thread(target=self.io.inbox.wake, daemon=True).start()

    # ---- the main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        self._restore()
        self.ledger = WorkLedger(self.config.directory / "work.jsonl", num_fragments=self.learner.plan.num_fragments,
                                 inner_step=self.learner.inner_step)
        self.ledger.start(inner_step=self.learner.inner_step, shares=fragment_shares(self.learner))
        total = self.run_config.inner_steps
        self._status_thread.start()
        if self.learner.inner_step >= total:
            logger.info("[learner %d | inner %d] already done", self.config.learner_id, self.learner.inner_step)
            return self._finish("done", leave=False, connected=False)
        self.io.start()
        wait_started: float | None = None
        last_checkpoint = self.clock.now()
        while self.learner.inner_step < total and not self._stop.is_set():
            self._apply_inbox()
            if self.refusal is not None:
                return self._finish("refused", leave=False)
            if not self.learner.joined:
                self._set(state="joining" if self.io.stats.welcomes == 0 else "disconnected")
                self.io.inbox.wait(None)
                continue
            if not self.learner.can_step:
                now = self.clock.now()
                wait_started = now if wait_started is None else wait_started
                remaining = self.run_config.learner.max_wait_s - (now - wait_started)
                if remaining <= 0:
                    self.learner.stop_waiting()
                    wait_started = None
                    continue
                self._set(state="waiting")
                self.io.inbox.wait(remaining)
                continue
            if wait_started is not None:
                self.sink.log({f"{self.prefix}/wait_s": self.clock.now() - wait_started}, step=self.learner.inner_step)
                wait_started = None
            self._train_one()
            if self.clock.now() - last_checkpoint >= self.config.checkpoint_every_s:
                self._save(wait=False)
                last_checkpoint = self.clock.now()
        done = self.learner.inner_step >= total
        self.io.flush(self.config.flush_timeout_s if done else STOP_FLUSH_S)
        return self._finish("done" if done else "stopped", leave=True)

    def _train_one(self) -> None:
        started = time.monotonic()
        batch = self.stream.next_batch()
        loss = inner_step(self.model, self.optimizer, batch, grad_clip=self.run_config.inner.grad_clip)
        # A straggler: this step takes `slowdown` times its compute time (a stop cuts the wait short).
        extra_s = (self.slowdown() - 1.0) * (time.monotonic() - started)
        if extra_s > 0:
            self._stop.wait(extra_s)
        step_s = time.monotonic() - started
        for update in self.learner.after_inner_step(batch.tokens):
            self.ledger.publish(update)  # before the I/O thread can write its fate
            self.io.send(update)
        self.io.inner_step = self.learner.inner_step
        tokens = self.progress.tokens + batch.tokens
        self._set(state="disconnected" if not self.io.connected else "training", loss=loss, tokens=tokens)
        self.sink.log({f"{self.prefix}/loss": loss, f"{self.prefix}/tokens": tokens, f"{self.prefix}/step_s": step_s},
                      step=self.learner.inner_step)

    def _apply_inbox(self) -> None:
        for message in self.io.inbox.take_ready():
            if isinstance(message, Refused):
                self.refusal = message.reason
            if (isinstance(message, Welcome) and self._synchronous and not self._positioned
                    and next_uncommitted_round(message) != self.learner.next_round):
                self.learner.take_schedule_position(message)
                self.ledger.position(inner_step=self.learner.inner_step, next_round=self.learner.next_round)
            if isinstance(message, Welcome):
                self._positioned = True
            applied = self.learner.stats.fragments_applied
            before = list(self.learner.versions)
            try:
                replies = self.learner.receive(message)
            except ValueError as exc:  # a malformed message: a fault to record, not a crash
                logger.error("[learner %d | inner %d] ignored a message from the syncer: %s",
                             self.config.learner_id, self.learner.inner_step, exc)
                continue
            if isinstance(message, Welcome):
                replaced = [p for p, v in enumerate(before) if v < 0 or v != self.learner.versions[p]]
                self.ledger.welcome(message, inner_step=self.learner.inner_step, replaced=replaced)
            elif isinstance(message, FragmentState) and self.learner.stats.fragments_applied > applied:
                self.ledger.received(message, inner_step=self.learner.inner_step)
            for reply in replies:
                if isinstance(reply, Update):
                    self.ledger.publish(reply)  # an update published again after a re-join
                self.io.send(reply)

    def _fate(self, update: Update, fate: str, reason: str) -> None:
        """From the sender thread (or `close`): what became of a published update."""
        self.ledger.fate(update, fate, reason)

    def _set(self, **changes: Any) -> None:
        values = {**self.progress.__dict__, "inner_step": self.learner.inner_step,
                  "versions": list(self.learner.versions), **changes}
        self.progress = _Progress(**values)

    def _finish(self, state: str, *, leave: bool, connected: bool = True) -> int:
        if connected:
            self.io.close(leave=leave)  # queued updates get their fate ("exit") before the end line
        self.ledger.end(state, inner_step=self.learner.inner_step)
        self.ledger.close()
        self._save()
        self._set(state=state)
        self._status_stop.set()
        self._status_thread.join()
        self.write_status()
        self.sink.event(state, learner_id=self.config.learner_id, inner_step=self.learner.inner_step)
        self.sink.close()
        return EXIT_REFUSED if state == "refused" else EXIT_OK

    # ---- checkpoints and status ------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        stats, io = self.learner.stats, self.io.stats
        current = {"updates_sent": stats.updates_sent, "updates_accepted": io.updates_accepted,
                   "updates_rejected": io.updates_rejected, "updates_dropped": io.updates_dropped,
                   "fragments_applied": stats.fragments_applied, "bytes_sent": self.client.bytes_sent,
                   "bytes_received": self.client.bytes_received, "joins": io.welcomes,
                   "waits_abandoned": stats.waits_abandoned}
        return {name: self.base[name] + current[name] for name in COUNTERS}

    def _save(self, *, wait: bool = True) -> None:
        """Checkpoint. The snapshot is taken here, between inner steps (a deep copy: the optimizer
        updates its tensors in place); writing and fsyncing happen in a background thread unless
        `wait`, so a periodic checkpoint costs the training loop only the copy."""
        if self._saver is not None:
            self._saver.join()  # one write at a time, in order
        state = copy.deepcopy({"learner": self.learner.state_dict(), "data": self.stream.state_dict()})
        meta = {"tokens": self.progress.tokens, "counters": self.counters()}
        self._saver = threading.Thread(target=save_state, args=(self.checkpoint_dir, state),
                                       kwargs={"serial": self.learner.inner_step, "meta": meta},
                                       name="learner-checkpoint", daemon=True)
        self._saver.start()
        if wait:
            self._saver.join()
        logger.debug("[learner %d | inner %d] checkpoint saved", self.config.learner_id, self.learner.inner_step)

    def _restore(self) -> None:
        self._restore_checkpoint()
        self._skip_trained_batches()

    def _restore_checkpoint(self) -> None:
        latest = load_latest_state(self.checkpoint_dir)
        if latest is None:
            logger.info("[learner %d] no local checkpoint: fresh optimizer, data from the start",
                        self.config.learner_id)
            return
        state, meta, _ = latest
        self.learner.load_state_dict(state["learner"])
        self.stream.load_state_dict(state["data"])
        self.base.update({k: int(v) for k, v in meta.get("counters", {}).items() if k in self.base})
        self._set(tokens=int(meta.get("tokens", 0)))
        self._last_rate = (time.monotonic(), self.progress.tokens)
        self.io.inner_step = self.learner.inner_step
        logger.info("[learner %d | inner %d] resumed from its checkpoint", self.config.learner_id,
                    self.learner.inner_step)
        self.sink.event("resume", learner_id=self.config.learner_id, inner_step=self.learner.inner_step)

    def _skip_trained_batches(self) -> None:
        """A learner killed hard trained past its last checkpoint. Those steps' work was merged or died
        with the process; training their batches again would only repeat data. So the data cursor and
        the step count move on to the last inner step the previous process logged (its own metrics),
        and the rounds due on the way are skipped: they were published, or lost, by that process."""
        reached = last_logged_step(self.config.directory / "metrics.jsonl", f"{self.prefix}/loss")
        skip = reached - self.learner.inner_step
        if skip <= 0:
            return
        tokens = sum(self.stream.next_batch().tokens for _ in range(skip))
        self.learner.skip_steps(skip)
        self._set(tokens=self.progress.tokens + tokens)
        self._last_rate = (time.monotonic(), self.progress.tokens)
        self.io.inner_step = self.learner.inner_step
        logger.info("[learner %d | inner %d] skipped %d step(s) trained after the checkpoint",
                    self.config.learner_id, self.learner.inner_step, skip)
        self.sink.event("skipped", learner_id=self.config.learner_id, inner_step=self.learner.inner_step, steps=skip)

    def status(self) -> dict[str, Any]:
        progress = self.progress
        now = time.monotonic()
        last_time, last_tokens = self._last_rate
        if now > last_time:
            self.tokens_per_s = (progress.tokens - last_tokens) / (now - last_time)
        self._last_rate = (now, progress.tokens)
        return {"time": time.time(), "pid": os.getpid(), "learner_id": self.config.learner_id,
                "state": progress.state, "inner_step": progress.inner_step,
                "inner_steps": self.run_config.inner_steps, "loss": progress.loss,
                "tokens_per_s": self.tokens_per_s, "tokens": progress.tokens, "versions": progress.versions,
                "connected": self.io.connected, **self.counters()}

    def write_status(self) -> None:
        atomic_write_json(self.config.directory / "status.json", self.status(), durable=False)

    def _status_loop(self) -> None:
        while not self._status_stop.wait(self.config.status_every_s):
            self.write_status()
            self.sink.log({f"{self.prefix}/tokens_per_s": self.tokens_per_s}, step=self.progress.inner_step)
