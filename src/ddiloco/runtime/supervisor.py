"""Supervision of a local run: keep one syncer and M learners alive until every learner is done.

One bounded poll loop (`SupervisorConfig.poll_interval_s`), no other waiting:

- The syncer starts first; learners start once it has written `syncer.json` (its real address).
  Restarts reuse that port, so learners already running reconnect to the new syncer by themselves.
- A child that dies is restarted after an exponential backoff (`Backoff`: 0.5 s doubling to 8 s,
  reset once a child has run for `stable_after_s`). Self-healing (docs/architecture.md, "Faults are data"): a dead
  learner stops only itself.
- Exit codes decide the rest: a learner exiting 0 is done and never restarted (unless a SIGTERM that the
  launcher did not send stopped it before the budget: `learner_exits.stopped_from_outside`; it is restarted
  and resumes from the checkpoint it saved at the stop), and so is one that crashed after its session had
  finished (its `status.json`, written by this process, says done: a native library aborting at interpreter
  exit, as gloo or NCCL teardown can, loses no work, and a restart would only finish again); exit 3 means the
  syncer refused it (its log says why) and exit 2 a usage error: neither would go any
  better a second time, so neither is restarted. The syncer is restarted on any exit but those two,
  which end the run. A learner's exit 4 (its syncer never answered within `connect_timeout_s`) is
  restarted like a crash: the syncer is this machine's own, and on its way back.
- A learner in a crash loop is given up as failed, with its log's last line as the reason
  (`learner_exits.CrashLoop`): starts in a row that fail before their session, or restarts in a row that fail
  without training past the furthest step reached. Any child, the syncer included, is given up once more than
  `max_restarts` starts in a row failed within `stable_after_s` of their start (`Slot.count_exit`: a death by a
  signal is a fault and does not count, a stable run starts the count again), so that a long run whose children
  are killed now and then goes on.
- With `standby_learners` > 0 it keeps that many warm learner processes (`ddiloco.runtime.standby`:
  torch and the learner's modules imported, waiting for a role); a restart runs in one when one is
  waiting, so it costs no interpreter start and no imports (first starts are cold).
- With `standby_syncer`, a standby syncer follows the syncer's durable state from the moment the syncer
  serves; when the syncer dies, the standby takes over by itself (it holds the run directory's lock once
  the dead syncer's is released) and becomes the supervised syncer; no cold restart. A standby that dies
  is started again after the refill delay.
- The run is finished when every learner is done (or will never run again); `shutdown()` then sends
  SIGTERM to whatever still runs (learners first, so they can say Leave to a live syncer; then the
  syncer, which evaluates the final validation loss) and SIGKILL after a timeout. A learner whose status says
  its session had finished when that SIGTERM came is done, not stopped.

Everything that happens is an `Event` handed to `on_event` (the progress view and the metrics sink).
`Event`, `Slot`, `ChildState` and `SupervisorConfig` are `ddiloco.runtime.supervised_roles`'s, shared with the Ray
supervisor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ddiloco.backoff import Backoff
from ddiloco.exit_status import EXIT_DONE, EXIT_REFUSED, EXIT_USAGE
from ddiloco.runtime.child_process import ChildProcess, stop_processes
from ddiloco.runtime.launcher import Launcher, connect_address, with_port
from ddiloco.runtime.learner_exits import (
    DONE_AFTER_SESSION,
    EXIT_LOG_LINES,
    RECENT_LINES,
    STOPPED_AFTER_SESSION,
    describe_done,
    describe_exit,
    describe_exit_with,
    describe_outside_stop,
    finished_session,
    reason_line,
    refusal_reason,
    started_wall,
    status_since,
    stopped_from_outside,
)
from ddiloco.runtime.standby import LEARNER_PRELOAD, StandbyPool
from ddiloco.runtime.supervised_roles import (
    EVALUATOR,
    SYNCER,
    ChildState,
    Event,
    Slot,
    SupervisorConfig,
)
from ddiloco.runtime.supervision_loop import SupervisionLoop

logger = logging.getLogger(__name__)

STOP_HINTS = {"learner": "a learner stops at its next step() call",
              EVALUATOR: "the evaluator evaluates the final global model first, if the run has one",
              SYNCER: "the syncer makes its last round durable first"}
"""What a child of each role does between its SIGTERM and its exit, for the line that says the launcher waits."""

PAUSE_S = 2.0
"""A poll this much later than the poll interval says the launcher itself did not run meanwhile (its job stopped with
SIGSTOP or Ctrl-Z, its machine held): that time is not the syncer's start-up (`_discount_pause`)."""


class Supervisor(SupervisionLoop):
    """Runs a syncer and M learners to completion. See the module docstring."""

    def __init__(self, config: SupervisorConfig, *, launcher: Launcher,
                 on_event: Callable[[Event], None] | None = None) -> None:
        self.config = config
        self.launcher = launcher
        self._on_event = on_event or (lambda event: None)
        backoff = lambda: Backoff(config.backoff_initial_s, config.backoff_max_s,
                                  stable_after_s=config.stable_after_s)
        self.syncer = Slot(SYNCER, None, backoff())
        self.learners = [Slot(f"learner-{i}", i, backoff()) for i in range(launcher.config.num_learners)]
        self.evaluator = Slot(EVALUATOR, None, backoff()) if launcher.config.evaluator else None
        """The read-only evaluator (`ddiloco.watch`); a run is finished without it."""
        self.standby = StandbyPool(launcher, size=config.standby_learners, name="standby-learner",
                                   preload=LEARNER_PRELOAD, threads=launcher.config.threads,
                                   refill_delay_s=config.standby_refill_delay_s, on_start=self._standby_started)
        self.syncer_address: str | None = None
        """Where learners dial the syncer, once known."""
        self.syncer_standby: ChildProcess | None = None
        """The standby syncer waiting to take over (`SupervisorConfig.standby_syncer`)."""
        self._syncer_standby_at: float | None = None
        """When to start the next standby syncer."""
        self._standby_syncer_pids: list[int] = []
        self._bind = launcher.config.bind
        self._stop_reason: str | None = None
        self._kill_now = False
        self.failure: str | None = None
        """Why the run cannot go on (the syncer cannot run), if so."""
        self._last_poll: float | None = None

    # ---- control ---------------------------------------------------------------------------------

    def hold(self, slot: Slot, until: float) -> None:
        """Do not restart `slot` before monotonic time `until`, however it exits: a machine that
        is being replaced (chaos runs) rather than a process the supervisor should bring back at once."""
        slot.held_until = until
        if slot.state == ChildState.BACKOFF and slot.restart_at is not None:
            slot.restart_at = max(slot.restart_at, until)

    def start(self) -> None:
        self._start_syncer()
        self.standby.fill()  # their imports overlap the syncer's start

    def poll(self) -> None:
        """One supervision step: notice exits, start what is due."""
        # Wall time throughout: the children are real processes (their start times are monotonic too).
        now = time.monotonic()
        self._discount_pause(now)
        self._poll_syncer(now)
        for slot in self.learners:
            self._poll_learner(slot, now)
        if self.evaluator is not None:
            self._poll_learner(self.evaluator, now, start=self._start_evaluator)
        if self._stop_reason is None:
            self.standby.fill()

    def _discount_pause(self, now: float) -> None:
        """A syncer starting while the launcher did not run (the whole job stopped, say) gets that time back: its
        start-up timeout counted it, and a job suspended for 125 s before syncer.json existed had its syncer killed
        and started again when it went on (`no syncer.json after 120 s`)."""
        last, self._last_poll = self._last_poll, now
        gap = 0.0 if last is None else now - last - self.config.poll_interval_s
        if gap > PAUSE_S and self.syncer.state == ChildState.STARTING:
            self.syncer.starting_since += gap
            logger.info("[syncer] the launcher did not run for %.1f s: not counted in the syncer's start-up", gap)

    @property
    def pids(self) -> list[int]:
        """Every pid this supervisor started: syncer, learners, standbys (handed out or not)."""
        return sorted({pid for slot in self.slots for pid in slot.pids} | set(self.standby.pids)
                      | set(self._standby_syncer_pids))

    def shutdown(self) -> None:
        """Stop every child that still runs: standbys, learners, then the syncer. Idempotent."""
        self.standby.close()
        if self.syncer_standby is not None:
            stop_processes([self.syncer_standby], self.config.learner_stop_timeout_s, kill_now=lambda: self._kill_now)
            self.syncer_standby = None
        self._syncer_standby_at = None
        running = [s for s in self.learners if s.pid is not None]
        if running:
            self._emit("stopping", None, f"stopping {len(running)} learner(s)")
            self._stop(running, self.config.learner_stop_timeout_s)
        for slot in self.learners:
            if not slot.state.final:
                slot.state = ChildState.STOPPED
        # The evaluator goes after the learners (its SIGTERM makes it evaluate the final global model) and
        # before the syncer it reads that model from.
        if self.evaluator is not None:
            if self.evaluator.pid is not None:
                self._emit("stopping", self.evaluator, "stopping")
                self._stop([self.evaluator], self.config.syncer_stop_timeout_s)
            if self.evaluator.state == ChildState.BACKOFF:  # it measured nothing since: the summary says why
                self.evaluator.reason = f"it was waiting to be started again: its last start {self.evaluator.last_exit}"
            if not self.evaluator.state.final:
                self.evaluator.state = ChildState.STOPPED
        if self.syncer.pid is not None:
            self._emit("stopping", self.syncer, "stopping")
            self._stop([self.syncer], self.config.syncer_stop_timeout_s)
        if not self.syncer.state.final:
            self.syncer.state = ChildState.STOPPED

    def _stop(self, slots: list[Slot], timeout_s: float) -> None:
        processes = [s.process for s in slots if s.process is not None]

        def waiting(pending: list[ChildProcess]) -> None:
            # Said, or a learner between two step() calls (a long evaluation of its own) held the launcher in
            # silence for the whole timeout.
            still = [slot for slot in slots if any(slot.process is child for child in pending)]
            who = ", ".join(f"{slot.name} (pid {slot.process.pid})" for slot in still if slot.process is not None)
            hints = "; ".join(dict.fromkeys(STOP_HINTS["learner" if slot.learner_id is not None else slot.name]
                                            for slot in still))
            self._emit("waiting", None, f"still waiting for {who} to stop: {hints}; SIGKILL {timeout_s:.0f} s after "
                       "the SIGTERM, or at once on a second Ctrl-C", names=[slot.name for slot in still])

        stop_processes(processes, timeout_s, kill_now=lambda: self._kill_now, on_wait=waiting)
        for slot in slots:
            assert slot.process is not None
            code = slot.process.returncode
            if slot.learner_id is not None and finished_session(self._status_since_start(slot)):
                # Its session had finished and it was on its way out when the stop came: done, as its status says.
                slot.state = ChildState.DONE
                self._emit("stopped", slot, f"stopped (exit {code}) {STOPPED_AFTER_SESSION}", exit_code=code)
            else:
                self._emit("stopped", slot, f"stopped (exit {code})", exit_code=code)

    # ---- the syncer ------------------------------------------------------------------------------

    def _start_syncer(self) -> None:
        slot = self.syncer
        slot.started(self.launcher.start_syncer(self._bind), state=ChildState.STARTING, since=time.monotonic())
        self._emit("started", slot, f"started (pid {slot.process.pid}, bind {self._bind})",
                   pid=slot.process.pid, restarts=slot.restarts)

    def _poll_syncer_standby(self, now: float) -> None:
        """Keep one standby syncer once the syncer serves (its address is the one the standby takes over)."""
        standby = self.syncer_standby
        if standby is not None and standby.poll() is not None:
            self._emit("exited", None, f"standby syncer (pid {standby.pid}) exited with "
                       f"{describe_exit(standby.returncode)}", exit_code=standby.returncode)
            self.syncer_standby = None
            self._syncer_standby_at = now + self.config.standby_refill_delay_s
        if (self.syncer_standby is None and self._syncer_standby_at is not None and now >= self._syncer_standby_at
                and self.syncer.state == ChildState.RUNNING and self._stop_reason is None):
            self.syncer_standby = self.launcher.start_syncer(self._bind, standby=True)
            self._standby_syncer_pids.append(self.syncer_standby.pid)
            self._syncer_standby_at = None
            self._on_event(Event("started", "syncer-standby", None,
                                 f"standby syncer started (pid {self.syncer_standby.pid}, bind {self._bind})",
                                 {"pid": self.syncer_standby.pid, "standby": True}))

    def _take_over(self, now: float) -> bool:
        """The syncer died: its standby takes over (it serves once the dead syncer's lock is released, which the
        kernel does at its death). False when there is no live standby."""
        standby, slot = self.syncer_standby, self.syncer
        if standby is None or standby.poll() is not None:
            return False
        self.syncer_standby = None
        slot.started(standby, state=ChildState.STARTING, since=now)
        slot.restarts += 1
        self._syncer_standby_at = now + self.config.standby_refill_delay_s
        self._emit("taken_over", slot, f"taken over by the standby syncer (pid {standby.pid})", pid=standby.pid,
                   restarts=slot.restarts, standby=True)
        return True

    def _poll_syncer(self, now: float) -> None:
        if self.config.standby_syncer:
            self._poll_syncer_standby(now)
        slot = self.syncer
        if slot.state == ChildState.BACKOFF and slot.restart_at is not None and now >= slot.restart_at:
            self._start_syncer()
            return
        if slot.process is None or slot.state not in (ChildState.STARTING, ChildState.RUNNING):
            return
        code = slot.process.poll()
        if code is not None:
            self._syncer_exited(code, now)
            return
        if slot.state == ChildState.STARTING:
            address = self.launcher.syncer_address(slot.process.pid)
            if address is not None:
                # Keep the port for restarts, so running learners find the new syncer where the old was.
                self._bind = with_port(self._bind, int(address.rpartition(":")[2]))
                self.syncer_address = connect_address(address)
                slot.state = ChildState.RUNNING
                self._emit("address", slot, f"serving on {address}", address=address)
                if self.config.standby_syncer and self.syncer_standby is None and self._syncer_standby_at is None:
                    self._syncer_standby_at = now  # the first standby at once; after a take-over, a refill later
            elif now - slot.starting_since > self.config.syncer_start_timeout_s:
                logger.warning("[syncer] no syncer.json after %.0f s: killing it",
                               self.config.syncer_start_timeout_s)
                slot.process.stop(self.config.learner_stop_timeout_s)
                self._syncer_exited(slot.process.returncode or -1, now, never_served=True)

    def _syncer_exited(self, code: int, now: float, *, never_served: bool = False) -> None:
        """The syncer's process exited with `code` (`never_served`: killed because it did not serve within
        `syncer_start_timeout_s`): give up, let the standby take over, or restart it."""
        slot = self.syncer
        assert slot.process is not None
        slot.exit_codes.append(code)
        if never_served:
            slot.failed_in_a_row += 1  # our own kill, not a fault; a failed start however long it took
        else:
            slot.count_exit(code, now - slot.starting_since, stable_after_s=self.config.stable_after_s)
        tail = slot.process.log_tail()
        self._emit("exited", slot, f"exited with {describe_exit_with(code, tail)}", exit_code=code,
                   log_tail=tail)
        exhausted = slot.restarts_exhausted(self.config.max_restarts, self.config.stable_after_s)
        if code in (EXIT_USAGE, EXIT_REFUSED) or exhausted is not None:
            slot.state = ChildState.FAILED
            slot.reason = reason_line(tail) if tail else describe_exit(code)
            if exhausted is not None:
                slot.reason += f" ({exhausted})"
            self.failure = f"the syncer cannot run: {slot.reason}"
            self._emit("failed", slot, self.failure, exit_code=code)
            return
        if self._stop_reason is None and self._take_over(now):
            return
        self._schedule_restart(slot, now)

    # ---- learners --------------------------------------------------------------------------------

    def _poll_learner(self, slot: Slot, now: float, *, start: Callable[[Slot], None] | None = None) -> None:
        """A learner's (or, with `start`, the evaluator's) start, exit and restart."""
        if slot.state == ChildState.PENDING or (
                slot.state == ChildState.BACKOFF and slot.restart_at is not None and now >= slot.restart_at):
            if self.syncer_address is not None:
                (start or self._start_learner)(slot)
            return
        if slot.state != ChildState.RUNNING or slot.process is None:
            return
        code = slot.process.poll()
        if code is None:
            return
        slot.exit_codes.append(code)
        slot.count_exit(code, now - slot.starting_since, stable_after_s=self.config.stable_after_s)
        lines = slot.process.log_tail(EXIT_LOG_LINES)
        tail = lines[-RECENT_LINES:]
        status = self._status_since_start(slot) if start is None else {}  # start is None: a learner
        if code == EXIT_DONE and stopped_from_outside(status, last_stop_step=slot.outside_stop_step):
            # This loop only polls while the launcher stops nothing: the SIGTERM came from elsewhere.
            slot.outside_stop_step = status["inner_step"]
            slot.crash_loop.count(code, status)
            self._emit("exited", slot, f"exited ({describe_outside_stop(status)})", exit_code=code, log_tail=tail)
            self._schedule_restart(slot, now)
        elif code == EXIT_DONE:
            slot.state = ChildState.DONE
            how = describe_done(status) if start is None else "done"
            self._emit("done", slot, f"exited ({how})", exit_code=code)
        elif code == EXIT_REFUSED:
            slot.state = ChildState.REFUSED
            slot.reason = refusal_reason(lines) if lines else "refused by the syncer"
            self._emit("refused", slot, f"refused by the syncer: {slot.reason}", exit_code=code,
                       reason=slot.reason)
        elif start is None and finished_session(status):
            slot.state = ChildState.DONE
            self._emit("done", slot, f"exited with {describe_exit(code)} {DONE_AFTER_SESSION}", exit_code=code,
                       log_tail=tail)
        elif (reason := self._give_up_reason(slot, code, lines, start)) is not None:
            slot.state, slot.reason = ChildState.FAILED, reason
            self._emit("failed", slot, f"failed: {slot.reason}", exit_code=code, reason=slot.reason)
        else:
            slot.last_exit = f"exited with {describe_exit_with(code, lines)}"
            self._emit("exited", slot, slot.last_exit, exit_code=code, log_tail=tail)
            self._schedule_restart(slot, now)

    def _give_up_reason(self, slot: Slot, code: int, tail: list[str], start: Callable[[Slot], None] | None
                        ) -> str | None:
        """Why a child that exited with a failure is not restarted, or None to restart it: a usage error, too many
        failed starts in a row (`Slot.restarts_exhausted`), or (a learner, the evaluator) a crash loop
        (`learner_exits.CrashLoop`, which this call counts; the evaluator's "session" is its first evaluation, the
        first write of its status file). A failed evaluator ends nothing else: the run goes on without evaluations."""
        if code == EXIT_USAGE and tail:
            return reason_line(tail)
        slot.crash_loop.count(code, self._status_since_start(slot))
        reason = slot.crash_loop.give_up_reason(
            code, tail, self.launcher.paths.log(slot.name), session="its session started" if start is None else
            "its first evaluation", max_before_session=self.config.max_exits_before_session,
            max_without_progress=self.config.max_exits_without_progress)
        if reason is not None:
            return reason
        if code == EXIT_USAGE:
            return describe_exit(code)
        exhausted = slot.restarts_exhausted(self.config.max_restarts, self.config.stable_after_s)
        return f"{describe_exit(code)} {exhausted}" if exhausted is not None else None

    def _status_since_start(self, slot: Slot) -> dict[str, Any]:
        """The learner's (or the evaluator's) status file if its current process wrote it (a stale one from an earlier
        start, or an earlier run before `--resume`, does not count), else {}."""
        assert slot.process is not None
        paths = self.launcher.paths
        path = paths.learner_status(slot.learner_id) if slot.learner_id is not None else paths.evaluator_status
        return status_since(path, started_wall(slot.process.started_at))

    def _start_evaluator(self, slot: Slot) -> None:
        """The evaluator: started with the learners, supervised like one; done when it exits 0."""
        assert self.syncer_address is not None
        env = self.launcher.learner_env(0, self.syncer_address, role="evaluator")
        argv = self.launcher.evaluator_argv(self.syncer_address)
        try:
            slot.started(self.launcher.start(slot.name, argv, self.launcher.config.threads, env_extra=env))
        except OSError as exc:
            self._cannot_start(slot, argv, exc)
            return
        self._emit("started", slot, f"started (pid {slot.process.pid})", pid=slot.process.pid, restarts=slot.restarts)

    def _start_learner(self, slot: Slot) -> None:
        assert slot.learner_id is not None and self.syncer_address is not None
        argv = self.launcher.learner_argv(slot.learner_id, self.syncer_address)
        env = self.launcher.learner_env(slot.learner_id, self.syncer_address)
        # A first start is cold: the standbys are for replacing learners that died.
        # A user's script reads its place in the run from the environment, which a standby (started before
        # the role was known) does not have: only the built-in learner, whose flags say it all, runs in one.
        warm = (self.standby.hand_out(slot.name, argv)
                if slot.restarts > 0 and not self.launcher.config.script else None)
        try:
            slot.started(warm or self.launcher.start(slot.name, argv, self.launcher.config.threads, env_extra=env))
        except OSError as exc:
            self._cannot_start(slot, argv, exc)
            return
        how = ", in a warm standby" if warm is not None else ""
        self._emit("started", slot, f"started (pid {slot.process.pid}{how})", pid=slot.process.pid,
                   restarts=slot.restarts, standby=warm is not None)

    def _cannot_start(self, slot: Slot, argv: list[str], exc: OSError) -> None:
        """The OS refused to start a learner's (or the evaluator's) command: its program is gone or not executable
        (`ddiloco run` checks it before anything starts, but it can change during a run). The same start would fail
        again, so the slot is failed with the reason, as a crash loop is, and the run goes on without it."""
        slot.state = ChildState.FAILED
        slot.reason = f"cannot start {argv[0]}: {exc.strerror or exc}"
        self._emit("failed", slot, f"failed: {slot.reason}", reason=slot.reason)

    def _standby_started(self, child: ChildProcess) -> None:
        self._on_event(Event("started", child.name, None, f"standby started (pid {child.pid})",
                             {"pid": child.pid, "standby": True}))

    # ---- shared ----------------------------------------------------------------------------------

    def _schedule_restart(self, slot: Slot, now: float) -> None:
        assert slot.process is not None
        # From `starting_since`, not the process's start: a syncer's standby ran long before it took over.
        delay = slot.backoff.after_run(now - slot.starting_since)
        slot.restarts += 1
        slot.restart_at = max(now + delay, slot.held_until or now)
        slot.state = ChildState.BACKOFF
        wait = max(delay, (slot.held_until or now) - now)  # a crash held down (chaos) waits for its hold
        held = " (held down)" if wait > delay else ""
        self._emit("restart_scheduled", slot, f"restarts in {wait:.1f} s{held} (restart {slot.restarts})",
                   delay_s=wait, restarts=slot.restarts)

    def _emit(self, kind: str, slot: Slot | None, message: str, **fields: Any) -> None:
        name = slot.name if slot is not None else "run"
        learner_id = slot.learner_id if slot is not None else None
        logger.info("[%s] %s", name, message)
        self._on_event(Event(kind, name, learner_id, message, fields))

