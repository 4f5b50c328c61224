"""`ddiloco.session`: the public learner API. Your model, your optimizer, your loop, one added line.

```python
import ddiloco
env = ddiloco.environment()                       # learner id, number of learners, device, seed
with ddiloco.session(model, optimizer, state={"data": loader, "sched": scheduler}) as sync:
    while not sync.done:
        ...; loss.backward(); optimizer.step(); optimizer.zero_grad()
        sync.step(tokens=batch_tokens)            # the one line the loop gains
```

ddiloco never calls the model (any `nn.Module`, any forward signature) and never owns the loop. A
`Session` wraps the `Learner` core and the learner's rules between messages (`LearnerRules`), and
moves messages through one of two transports:

- **gRPC** (the real runtime): where to connect comes from the environment that `ddiloco run` sets
  (`environment()`, the `DDILOCO_*` variables), or from keywords (`syncer="host:port"`,
  `learner_id=`, `run_dir=`, `token_file=`, `config=`, TLS). Background threads (`LearnerIO`) own the
  channel; the training thread only applies what arrived between two inner steps. With a run
  directory the session also checkpoints (`learners/N/checkpoint/`: its progress, the inner
  optimizer and every object in `state=`, every `checkpoint_every_s` and at the end), keeps the work
  ledger (`learners/N/work.jsonl`), metrics and `status.json`; a restarted learner resumes its
  optimizer, schedule and data position from there (`sync.inner_step` says where). SIGTERM ends the
  loop cleanly: `done` turns true after the current step.
- **in-process** (`hub=InProcessHub(...)`): the syncer in the same process, for notebooks and tests.
  `step()` never blocks there; `ready` says whether the waiting rule lets the learner train now.

A learner of several torch.distributed ranks (torchrun, DDP, FSDP2) runs this `Session` on its rank 0
only, with its `LearnerGroup` (`ddiloco.learner_group`): fragments it applies and publishes are written
to and read from every rank; the others run a `FollowerSession` (`ddiloco.session_setup` picks). Over
gRPC a publish costs the training thread only a copy of the fragment (`ddiloco.publisher`).

Entering the session joins: the learner's own initialisation is replaced by the global parameters
(the first learner of a new run provides them). A syncer that refuses the learner ends the session with
`RefusedError` (exit status 3); one that never answers, after `LearnerConfig.connect_timeout_s`, with
`UnreachableError` (exit status 4). `step()` publishes the fragments that fall due and
applies what the syncer sent; while the waiting rule blocks it waits, bounded by
`LearnerConfig.max_wait_s`. Leaving the `with` block normally (or `done`) publishes every fragment's
unpublished work once more, so the final global model includes it. Embedding tables are found by
module type (`nn.Embedding`), or by `DilocoConfig.embedding_pattern` when it is set.

This module owns the `Session` and how it ends (`RefusedError`, `UnreachableError`); what it applies and sends, and
how its last work gets out, are `ddiloco.session_messages`, its checkpoint is `ddiloco.learner_checkpoint`, its
progress, counters and status file `ddiloco.learner_status`, and the `with` block and SIGTERM handling it shares with
`FollowerSession` `ddiloco.session_lifecycle`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.clock import Clock, MonotonicClock
from ddiloco.exit_status import EXIT_REFUSED, EXIT_UNREACHABLE, ForeignCheckpointError, RefusedError, UnreachableError
from ddiloco.inprocess import InProcessHub
from ddiloco.interrupts import StopFlag
from ddiloco.learner import Learner
from ddiloco.learner_checkpoint import LearnerCheckpoint, Stateful, stateful_objects
from ddiloco.learner_group import LearnerGroup, unwrap
from ddiloco.learner_rules import Action, LearnerRules
from ddiloco.learner_status import StatusReporter
from ddiloco.metrics import MetricSink, NullSink, run_dir_sink
from ddiloco.model_checks import check_optimizer_of_model
from ddiloco.run_config import RunConfig
from ddiloco.session_lifecycle import SessionLifecycle
from ddiloco.session_messages import SessionMessages
from ddiloco.session_transport import GrpcTransport, HubTransport, SessionTransport
from ddiloco.step_arguments import check_tokens_bound, step_loss, user_metrics
from ddiloco.work_ledger import WorkLedger, fragment_shares

logger = logging.getLogger(__name__)

UNBOUNDED_STEPS = 2**62
"""The inner-step budget of a session without a run config (`ddiloco.session` in process, no `inner_steps`): `done`
never turns true by itself, and a loop that ends is no early end."""
STOP_FLUSH_S = 1.0
"""After a stop request (SIGTERM), how long queued updates may take to go out before the learner leaves."""


# ---- the session ------------------------------------------------------------------------------------------

class Session(SessionLifecycle):
    """One learner's participation in a run, around the user's model and optimizer. Use `session()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: RunConfig, learner_id: int,
                 state: Mapping[str, Stateful] | None = None, hub: InProcessHub | None = None,
                 syncer: str | None = None, run_dir: str | Path | None = None, token: str | None = None,
                 link: str | None = None, tls_ca: bytes | None = None, tls_server_name: str | None = None,
                 chaos_control: str | Path | None = None, checkpoint_every_s: float = 10.0,
                 status_every_s: float = 1.0, flush_timeout_s: float = 5.0, handle_sigterm: bool = True,
                 sink: MetricSink | None = None, clock: Clock | None = None, max_tokens_per_step: int = 0,
                 group: LearnerGroup | None = None, declare_config: bool = False) -> None:
        super().__init__(handle_sigterm=handle_sigterm and hub is None)
        for name, value in (("checkpoint_every_s", checkpoint_every_s), ("status_every_s", status_every_s)):
            if not value > 0:
                raise ValueError(f"{name}={value!r} is invalid: expected seconds > 0")
        if (hub is None) == (syncer is None):
            raise ValueError("a session needs exactly one of hub= (in process) or syncer= (HOST:PORT)")
        if group is not None and (hub is not None or not group.leader):
            raise ValueError("a learner of several ranks trains over gRPC (syncer=), and only its rank 0 runs a "
                             "Session (the others follow it: ddiloco.session() makes each side)")
        if not 0 <= learner_id < config.num_learners:
            raise ValueError(f"learner_id={learner_id} is invalid: the run has {config.num_learners} learners "
                             f"(ids 0..{config.num_learners - 1})")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.state = stateful_objects(state)
        self.config = config
        self.model = model
        """The model as the user gave it (with its DDP, DataParallel or torch.compile wrapper: calling it trains as
        their loop does); the run syncs the plain module inside (`learner_group.unwrap`)."""
        self.optimizer = optimizer
        self.clock = clock or MonotonicClock()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.directory = self.run_dir / "learners" / str(learner_id) if self.run_dir is not None else None
        self.prefix = f"learner/{learner_id}"
        self.checkpoint_every_s = checkpoint_every_s
        self._checkpoint_due = False
        """A periodic checkpoint fell due in `step()`, taken at the next `done` (or the next `step()`, if sooner)."""
        self.status_every_s = status_every_s
        self.flush_timeout_s = flush_timeout_s
        self.group = group
        """The learner's other torch.distributed ranks (`ddiloco.learner_group`), or None: a one-process learner."""
        self.learner = Learner(config.diloco, learner_id=learner_id, model=unwrap(model), optimizer=optimizer,
                               max_tokens_per_step=max_tokens_per_step, access=group)
        if group is not None:
            group.fragments = self.learner.plan.fragments
        if declare_config:  # the model and data are `config`'s (the built-in learner): the syncer checks them
            self.learner.run_config = config.to_dict()
        self._genesis: dict[str, torch.Tensor] | None = None
        """Sharded parameters' full initial values, gathered before the join (`_gather_genesis`)."""
        self._chaos = None
        if chaos_control is not None:
            from ddiloco.fault_control import ChaosControl

            # Seeded by the learner id: each learner draws its own drops and corruptions, reproducibly.
            self._chaos = ChaosControl(Path(chaos_control), seed=learner_id)
        ledger = WorkLedger(self.directory / "work.jsonl", num_fragments=self.learner.plan.num_fragments,
                            inner_step=0) if self.directory is not None else None
        self.rules = LearnerRules(self.learner, config.learner, events=ledger,
                                  synchronous=config.quorum.min_quorum >= config.num_learners > 1)
        self._ledger = ledger
        self.sink: MetricSink = sink or (run_dir_sink(self.directory) if self.directory is not None else NullSink())
        self.transport: SessionTransport
        self._run: tuple[str, Any] = ("hub", id(hub)) if hub is not None else ("syncer", syncer)
        """The run this session takes part in, for the rule of one open session per learner (`_key`)."""
        if hub is not None:
            self.transport = HubTransport(hub, self.learner)
        else:
            assert syncer is not None
            params = (lambda: self._genesis) if group is not None and group.sharded else None
            self.transport = GrpcTransport(self.learner, self.rules, address=syncer, token=token, config=config,
                                            link=link, tls_ca=tls_ca, tls_server_name=tls_server_name,
                                            chaos=self._chaos, clock=self.clock, genesis_params=params)
        self._stop = StopFlag()
        """Set by `request_stop`, from a signal handler too (a `threading.Event` there could wait for ever)."""
        self.messages = SessionMessages(self.learner, self.rules, self.transport, config=config.learner,
                                        clock=self.clock, stop=self._stop, publish_off_thread=hub is None)
        """What the session applies and sends, its publisher thread over gRPC, its last work
        (`ddiloco.session_messages`)."""
        self._released = False
        """Whether the publisher thread, the work ledger and the sink were let go (`_release`)."""
        self.reporter = StatusReporter(self.learner, self.transport, inner_steps=config.inner_steps,
                                       directory=self.directory, every_s=status_every_s, sink=self.sink,
                                       prefix=self.prefix)
        """The learner's progress, counters and status.json (`ddiloco.learner_status`)."""
        self._checkpoint: LearnerCheckpoint | None = None
        """learners/N/checkpoint/ (`ddiloco.learner_checkpoint`), or None without a run directory."""
        if self.directory is not None:
            self._checkpoint = LearnerCheckpoint(self.directory / "checkpoint", learner=self.learner, state=self.state,
                                                 group=group, reporter=self.reporter)
        self._last_checkpoint = 0.0
        self._step_started: float | None = None
        self._optimizer_groups = len(self.learner.optimizer.param_groups)
        """The optimizer's parameter groups when last checked (`_check_added_groups`)."""
        self.final_state: str | None = None

    # ---- what the loop reads -------------------------------------------------------------------------

    @property
    def learner_id(self) -> int:
        return self.learner.learner_id

    @property
    def inner_step(self) -> int:
        """Inner steps this learner has trained in the run (resumed from its checkpoint after a restart)."""
        return self.learner.inner_step

    @property
    def inner_steps(self) -> int:
        """The run's inner-step budget (`--inner-steps`), after which `done` turns true: with `inner_step`, what a
        learning-rate schedule of your own loop can follow (`ddiloco.training.inner_lr` is the built-in one)."""
        return self.config.inner_steps

    @property
    def done(self) -> bool:
        """True once the run's inner-step budget is reached, or a stop was requested (SIGTERM). Asked at the top of the
        loop (`while not sync.done`), it also takes a periodic checkpoint that fell due in the last `step()`: there, the
        iteration is over, the scheduler stepped after `sync.step()` included (`_checkpoint_due`)."""
        if self._checkpoint_due:
            self._take_due_checkpoint()
        return self._over_budget_or_stopped()

    def _over_budget_or_stopped(self) -> bool:
        return self.learner.inner_step >= self.config.inner_steps or self._stop.is_set()

    def _take_due_checkpoint(self) -> None:
        self._checkpoint_due = False
        if self._checkpoint is not None and not self._closed:
            self._checkpoint.save(wait=False)
            self._last_checkpoint = self.clock.now()

    @property
    def ready(self) -> bool:
        """Whether the waiting rule lets the learner train now (always, after `step()` returns over gRPC). In
        process, asking applies what the hub delivered meanwhile."""
        if not getattr(self.transport, "blocking", True):
            self._settle()
        return self.rules.next(self.clock.now()).action is Action.STEP

    def request_stop(self) -> None:
        """Safe from a signal handler and from any thread: `done` turns true and a wait in `step()` ends (a SIGTERM
        does this; so does the watch of a launcher that is gone, `ddiloco.launcher_watch`)."""
        self._stop.set()
        self.transport.wake()

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return "learner", self._run, self.learner_id

    def _open(self) -> None:
        """Resume from the local checkpoint (if any), join, and return once the global parameters are loaded. A start
        that fails or is interrupted (Ctrl-C while it waits for the syncer) ends as a failed session: its threads go
        with it, instead of retrying the syncer behind the script (a notebook's next session joined beside them)."""
        self.messages.open()
        try:
            self._join()
        except BaseException:
            if not self._closed:
                try:
                    self._finish("failed", flush=False)
                except Exception:
                    logger.exception("[learner %d] its session's start failed, and so did ending it",
                                     self.learner_id)
            raise

    def _join(self) -> None:
        self._restore()
        if self._ledger is not None:
            self._ledger.start(inner_step=self.learner.inner_step, shares=fragment_shares(self.learner))
        self.reporter.start()
        self._last_checkpoint = self.clock.now()
        self._gather_genesis()
        self.transport.start()
        self._settle()
        joined = self._checkpoint is not None and self.learner.joined  # (not when stopped before its Welcome)
        foreign = self._checkpoint.foreign(self.learner.versions) if joined else None
        if foreign is not None:
            self._checkpoint = None  # not written over: its run may be resumed
            logger.error("[learner %d] %s", self.learner_id, foreign)
            self._finish("refused", flush=False)
            raise ForeignCheckpointError(foreign)
        self._warn_if_state_starts_afresh()
        if self._genesis is not None:
            # Joined: the full copy goes; the base copies of the global values stand in for it from now on.
            self._genesis = {name: base[name] for base in self.learner.local.base for name in base}
        self._end_call()
        self._step_started = time.monotonic()

    def _gather_genesis(self) -> None:
        """Sharded parameters: gather their full values now (a collective, on the training thread), in case this
        learner's are the run's first (the transport proposes them from its own thread)."""
        if self.group is None or not self.group.sharded:
            return
        self._genesis = {}
        for p, names in enumerate(self.learner.plan.fragments):
            self._genesis.update(self.group.read(p, names))

    def _end_call(self, *, exit_status: int = 0) -> None:
        """The followers' ranks return from the session call they are in (`LearnerGroup.serve`)."""
        if self.group is not None:
            self.group.end(self.learner.inner_step, done=self._over_budget_or_stopped() or self._closed,
                           exit_status=exit_status)

    def _check_added_groups(self) -> None:
        """A group the script added to its optimizer (`add_param_group`) holds only the model's parameters, as the
        session checked of the optimizer at its start (`model_checks.check_optimizer_of_model`); one `len()` a step."""
        optimizer = self.learner.optimizer
        if len(optimizer.param_groups) != self._optimizer_groups:
            try:
                check_optimizer_of_model(self.learner.model, optimizer)
            except ValueError as exc:
                raise ValueError(f"at inner step {self.learner.inner_step}, after optimizer.add_param_group: {exc}") \
                    from None
            self._optimizer_groups = len(optimizer.param_groups)

    def log(self, metrics: Mapping[str, Any], *, step: int | None = None) -> None:
        """Log scalars of the script's own (accuracy, learning rate, gradient norm) beside ddiloco's, as
        `learner/N/NAME`: in this learner's metrics.jsonl, the run's merged one and TensorBoard. `step` defaults to
        the inner step the last `step()` completed, where that step's loss is: call it after `sync.step()` for the
        step's values. A value is one number (a float, or a tensor or array of one element); a NaN is written as
        null."""
        self.sink.log(user_metrics(self.prefix, metrics), step=self.learner.inner_step if step is None else int(step))

    def step(self, tokens: int, *, loss: float | None = None) -> None:
        """Call once after each `optimizer.step()`: `tokens` is how many tokens (or samples) the inner step
        trained on (the syncer weights learners by it); `loss`, if given, is logged and shown."""
        tokens = self._check_step(tokens)
        loss = step_loss(loss)
        check_tokens_bound(tokens, self.config.quorum.max_tokens_per_step)
        self._check_added_groups()
        if self._checkpoint is not None and not self._checkpoint.checked:
            self._checkpoint.check()  # a state= the checkpoint cannot keep stops the loop now, not 10 s in
        started = self._step_started or time.monotonic()
        if self.group is not None:
            tokens, stop = self.group.step(tokens)  # the learner trained on every rank's batch
            check_tokens_bound(tokens, self.config.quorum.max_tokens_per_step)
            if stop:
                self.request_stop()
        self._straggle(started)
        self.messages.take_withheld()
        step_s = time.monotonic() - started
        for update in self.rules.after_inner_step(tokens, seconds=step_s):
            self.messages.send(update)
        total = self.reporter.progress.tokens + tokens
        self.reporter.set(state="training" if self.transport.connected else "disconnected",
                          loss=loss if loss is not None else self.reporter.progress.loss, tokens=total)
        metrics = {f"{self.prefix}/tokens": total, f"{self.prefix}/step_s": step_s}
        if loss is not None:
            metrics[f"{self.prefix}/loss"] = loss
        self.sink.log(metrics, step=self.learner.inner_step)
        if self._checkpoint_due:  # due at the last step, and `done` not asked since: taken here, as it used to be
            self._take_due_checkpoint()
        elif self._checkpoint is not None and self.clock.now() - self._last_checkpoint >= self.checkpoint_every_s:
            if self._checkpoint.writing:
                # The one before is still being written: this one waits for it, the loop does not (asked again at
                # the next step).
                self._checkpoint.overdue(self.checkpoint_every_s)
            elif self.group is None:
                # At the next `sync.done`, once the loop's iteration is over: taken here, it lacked what the loop does
                # after `step()` (a scheduler stepped there came back one step behind after a kill -9, per crash).
                self._checkpoint_due = True
            else:  # its ranks take part in a checkpoint from inside this call (`LearnerGroup.checkpoint`)
                self._take_due_checkpoint()
        if not self._over_budget_or_stopped():
            self._settle()
        self._end_call()
        self._step_started = time.monotonic()

    def _straggle(self, started: float) -> None:
        """A straggler injected by a chaos run: this step takes `slowdown` times its compute time."""
        if self._chaos is None:
            return
        extra_s = (self._chaos.slowdown() - 1.0) * (time.monotonic() - started)
        if extra_s > 0:
            self._stop.wait(extra_s)

    def _settle(self) -> None:
        """Apply what arrived; then wait as the rules say until the next inner step may run (gRPC), or
        until nothing more can happen without another learner's step (in process)."""
        while True:
            self.messages.apply_inbox()
            now = self.clock.now()
            nxt = self.rules.next(now)
            if nxt.action is Action.REFUSED:
                self._refused()
            if nxt.action is Action.STEP:
                if self.rules.last_wait_s is not None:
                    self.sink.log({f"{self.prefix}/wait_s": self.rules.last_wait_s}, step=self.learner.inner_step)
                    self.rules.last_wait_s = None
                return
            if self._stop.is_set():
                return
            if not getattr(self.transport, "blocking", True):
                self.transport.wait(0.0)  # in process: rounds whose grace ended close now
                self.messages.apply_inbox()
                return
            if nxt.action is Action.JOIN:
                if self.transport.unreachable is not None:
                    self._unreachable(self.transport.unreachable)
                self.reporter.set(state="joining" if self.rules.welcomes == 0 else "disconnected")
                self.transport.wait(None)
            else:
                self.reporter.set(state="waiting")
                self.transport.wait(max(0.0, (nxt.until or now) - now))

    def _refused(self) -> None:
        reason = self.rules.refusal or "refused"
        logger.error("[learner %d] refused by the syncer: %s", self.learner_id, reason)
        self._finish("refused", flush=False)
        raise RefusedError(reason)

    def _unreachable(self, reason: str) -> None:
        self._finish("unreachable", flush=False)
        raise UnreachableError(reason)

    def close(self, *, failed: bool = False) -> None:
        """Publish the last work (unless `failed` or stopped), flush, leave, checkpoint. Idempotent. A session never
        started only lets go of its publisher thread and its files."""
        if not self._entered:
            self._end()
            return
        if self._closed:
            return
        done = self.learner.inner_step >= self.config.inner_steps
        state = "failed" if failed else ("done" if done else "stopped")
        if state == "stopped" and not self._stop.is_set() and self.config.inner_steps < UNBOUNDED_STEPS:
            logger.warning("[learner %d | inner %d] its loop ended before the run's budget of %d inner steps "
                           "(sync.done was False): its last work is sent, and it stops here", self.learner_id,
                           self.learner.inner_step, self.config.inner_steps)
        if self.group is not None and not failed:
            try:
                self.group.meet_at_close(self.learner.inner_step)  # bounded: another rank may still be in its loop
            except BaseException:
                self._finish("failed", flush=False)
                raise
        self._finish(state, flush=not failed and not self._stop.is_set())

    def _finish(self, state: str, *, flush: bool) -> None:
        """Send the last work, leave, checkpoint, and release the session's threads, connection and files. The
        release happens whatever interrupts the rest (a second Ctrl-C, a `state=` object whose state_dict raises):
        the session is closed once this begins, so an interrupted close left a learner that stayed connected, with its
        threads, for the life of the process (a notebook's next session of it was refused as a second process)."""
        self._closed = True
        self.final_state = state
        ended = False
        try:
            try:
                self.messages.send_last_work(flush=flush, flush_s=self.flush_timeout_s if state == "done"
                                             else STOP_FLUSH_S)
            finally:
                self.messages.close_publisher(0.0)  # interrupted before it was closed
                self.transport.close(leave=state not in ("refused", "unreachable"))
            self.rules.end(state)
            # Before the first Welcome no inner step ran: nothing new to keep. A failed learner of several ranks
            # keeps its last periodic checkpoint: saving needs every rank, and the failure may be that one is gone. A
            # process another one replaced leaves the checkpoint to that process (which resumed from it and trains on).
            if (self._checkpoint is not None and self.rules.welcomes > 0 and not (state == "failed" and self.group)
                    and not self.rules.refused_for_another_process):
                self._checkpoint.save()
            self.reporter.stop_requested = self._stop.is_set()
            self.reporter.set(state=state)
            ended = True
            self.sink.event(state, learner_id=self.learner_id, inner_step=self.learner.inner_step)
            if state != "failed":
                # After a failure the group's collectives may be what failed: the followers end with this process.
                self._end_call(exit_status={"refused": EXIT_REFUSED, "unreachable": EXIT_UNREACHABLE}.get(state, 0))
        finally:
            if not ended:  # the close itself failed or was interrupted: status.json must not say "training"
                self.final_state = "failed"
                self.reporter.set(state="failed")
            self.reporter.stop()
            self._end()  # last: a handler of the user's from before the session runs once it has checkpointed and left

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self.messages.close_publisher(0.0)
        if self._ledger is not None:
            self._ledger.close()
        self.sink.close()

    # ---- checkpoints ------------------------------------------------------------------------------------------

    def _restore(self) -> None:
        restored = self._checkpoint is not None and self._checkpoint.restore()
        self.reporter.carry_over(restored=restored)
        if not restored:
            return
        self.rules.resumed = True
        logger.info("[learner %d | inner %d] resumed from its checkpoint", self.learner_id, self.learner.inner_step)
        self.sink.event("resume", learner_id=self.learner_id, inner_step=self.learner.inner_step)

    def _warn_if_state_starts_afresh(self) -> None:
        """Joined with no checkpoint of its own (a learner that joins a run under way, or one restarted before its first
        checkpoint), the learner took the run's position (`Learner.take_schedule_position`): the `state=` objects start
        from nothing there, a scheduler warms up again mid-run and the data starts over. Said once, as it cannot be
        undone here."""
        if self._checkpoint is None or self.rules.resumed or self.learner.inner_step == 0 or not self.state:
            return
        logger.warning("[learner %d | inner %d] no checkpoint of its own: the learner took the run's position, inner "
                       "step %d, and its state= objects (%s) start afresh there, as the script built them (a scheduler "
                       "from its first step, the data from its start). A schedule driven from sync.inner_step follows "
                       "the position", self.learner_id, self.learner.inner_step, self.learner.inner_step,
                       ", ".join(repr(name) for name in self.state))
