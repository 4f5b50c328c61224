"""Supervision of a run whose syncer and learners are Ray actors (`ddiloco run --ray [ADDRESS]`).

The same surface as `supervisor.Supervisor` (its `Slot`s, `ChildState`s and `Event`s, `run`, `request_stop`,
`finished`), so `ddiloco run` keeps its live view, run directory, summary and `--resume` unchanged; what
differs is who restarts. Each role is a `ray_actor.RoleActor` with `max_restarts` (the local supervisor's
`SupervisorConfig.max_restarts`) and its resources: learners and the evaluator `--cpus-per-learner` and
`--gpus-per-learner`, the syncer `ray_options.SYNCER_CPUS`. Ray restarts a role whose process died at once
(no backoff: Ray places it again); this loop only watches, by asking every actor for its `status()` every
`STATUS_EVERY_S` without ever blocking on one (`ray.wait` with no timeout), and turns what it sees into the
local supervisor's events: a new incarnation is an `exited` + `restart_scheduled` + `started`, a kept exit
is `done`, `refused` or `failed`, an actor Ray gave up on is `failed`.

The syncer's actor is created first, the learners' and the evaluator's right after it; each of those asks
the syncer actor where it serves before every start of its process. Should a restarted syncer come back
on another address (another node), every learner is restarted through Ray so it dials the new one.
`shutdown()` stops in the local order (learners, which say Leave; the evaluator, which evaluates the final
model; the syncer, which makes its last round durable), ends every actor, and stops a local Ray instance
(`ray_cluster.RayCluster`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.backoff import Backoff
from ddiloco.exit_status import EXIT_DONE, EXIT_REFUSED
from ddiloco.runtime.launcher import Launcher
from ddiloco.runtime.learner_exits import (
    DONE_AFTER_SESSION,
    STOPPED_AFTER_SESSION,
    describe_exit,
    describe_exit_with,
    finished_session,
    reason_line,
    refusal_reason,
    started_wall,
    status_since,
)
from ddiloco.runtime.ray_actor import ACTOR_RUNTIME_ENV, LEARNER, RoleActor, RoleSpec
from ddiloco.runtime.ray_cluster import RayCluster
from ddiloco.runtime.ray_options import SYNCER_CPUS, RayOptions, import_ray
from ddiloco.runtime.run_paths import RunPaths
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

STATUS_EVERY_S = 0.25
"""How often each actor is asked for its status (a dead process is Ray's to restart, not this loop's)."""
STATUS_STALE_S = 10.0
"""A status call unanswered this long (an actor being restarted) is dropped and asked again."""
STOP_MARGIN_S = 10.0
"""Beyond a role's SIGTERM -> SIGKILL timeout, how long its actor may take to answer `stop()`."""
WAIT_POLL_S = 0.1


@dataclass
class RemoteProcess:
    """What the live view needs of a role's current process (`Slot.process`): its pid, and how it ended."""

    pid: int
    node: str
    started_at: float
    """Monotonic seconds on the driver, when it first saw this process."""
    returncode: int | None = None


class RaySupervisor(SupervisionLoop):
    """Runs a syncer and M learners to completion as Ray actors. See the module docstring."""

    def __init__(self, config: SupervisorConfig, *, launcher: Launcher, options: RayOptions,
                 on_event: Callable[[Event], None] | None = None) -> None:
        launch = launcher.config
        self.config = config
        self.options = options
        self.launch = dataclasses.replace(launch, run_dir=Path(launch.run_dir).resolve())
        self.paths = RunPaths(Path(self.launch.run_dir))
        self._on_event = on_event or (lambda event: None)
        backoff = lambda: Backoff(config.backoff_initial_s, config.backoff_max_s,
                                  stable_after_s=config.stable_after_s)
        self.syncer = Slot(SYNCER, None, backoff())
        self.learners = [Slot(f"learner-{i}", i, backoff()) for i in range(launch.num_learners)]
        self.evaluator = Slot(EVALUATOR, None, backoff()) if launch.evaluator else None
        self.cluster = RayCluster(options)
        self.syncer_address: str | None = None
        self.failure: str | None = None
        self._session = uuid.uuid4().hex
        self._actors: dict[str, Any] = {}
        self._incarnations: dict[str, int] = {}
        self._pending: dict[str, tuple[Any, float]] = {}
        """name -> (the unanswered status call, when it was made)."""
        self._asked_at: dict[str, float] = {}
        self._stop_reason: str | None = None
        self._kill_now = False
        self._actor_class: Any = None

    # ---- the Supervisor surface -------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Every pid of the run's processes, and of the local Ray instance's."""
        return sorted({pid for slot in self.slots for pid in slot.pids} | set(self.cluster.pids))

    def start(self) -> None:
        ray = import_ray()
        evaluator = self.evaluator is not None
        cpus = self.options.cpus_needed(num_learners=len(self.learners), evaluator=evaluator)
        gpus = self.options.gpus_needed(num_learners=len(self.learners), evaluator=evaluator)
        self._emit("ray", None, self.cluster.start(cpus_needed=cpus))
        have = self.cluster.resources()
        if have.get("CPU", 0) < cpus or have.get("GPU", 0) < gpus:
            self._emit("ray", None, f"the cluster has {have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs; "
                       f"the run reserves {cpus:g} and {gpus:g}: actors wait until Ray has them")
        self._actor_class = ray.remote(RoleActor)
        self._create(self.syncer, self._spec(SYNCER, SYNCER), num_cpus=SYNCER_CPUS, num_gpus=0)
        # At once, not once the syncer serves: each learner's actor (a new worker process) starts while the
        # syncer does, and waits in its constructor for the syncer's address before starting its process.
        for slot in self._learner_slots:
            self._create_learner(slot)

    def poll(self) -> None:
        now = time.monotonic()
        self._ask(now)
        for name, result in self._answers():
            slot = self._slot(name)
            if slot is not None and not slot.state.final:
                self._on_status(slot, result, now)

    @property
    def _learner_slots(self) -> list[Slot]:
        """The learners and the evaluator: the roles that dial the syncer."""
        return [*self.learners, *([self.evaluator] if self.evaluator is not None else [])]

    # ---- actors ---------------------------------------------------------------------------------------

    def _spec(self, role: str, name: str, learner_id: int = 0) -> RoleSpec:
        return RoleSpec(role=role, name=name, launch=self.launch, session=self._session, learner_id=learner_id,
                        bind=self.launch.bind, cwd=os.getcwd(),
                        syncer_start_timeout_s=self.config.syncer_start_timeout_s,
                        syncer_wait_s=self.config.syncer_start_timeout_s, syncer_actor=self._actor_name(SYNCER),
                        max_exits_before_session=self.config.max_exits_before_session,
                        max_exits_without_progress=self.config.max_exits_without_progress)

    def _actor_name(self, name: str) -> str:
        return f"ddiloco-{self._session[:8]}-{name}"

    def _create(self, slot: Slot, spec: RoleSpec, *, num_cpus: float, num_gpus: float) -> None:
        options = {"max_restarts": self.config.max_restarts, "max_task_retries": 0, "num_cpus": num_cpus,
                   "num_gpus": num_gpus, "name": self._actor_name(slot.name), "runtime_env": ACTOR_RUNTIME_ENV}
        self._actors[slot.name] = self._actor_class.options(**options).remote(spec)
        slot.state = ChildState.STARTING
        slot.starting_since = time.monotonic()
        self._emit("placed", slot, f"placed as a Ray actor ({num_cpus:g} CPU, {num_gpus:g} GPU)")

    def _create_learner(self, slot: Slot) -> None:
        role, learner_id = (EVALUATOR, 0) if slot.learner_id is None else (LEARNER, slot.learner_id)
        self._create(slot, self._spec(role, slot.name, learner_id), num_cpus=self.options.cpus_per_learner,
                     num_gpus=self.options.gpus_per_learner)

    def _ask(self, now: float) -> None:
        for name, actor in self._actors.items():
            slot = self._slot(name)
            if slot is None or slot.state.final:
                continue
            pending = self._pending.get(name)
            if pending is not None and now - pending[1] < STATUS_STALE_S:
                continue
            if pending is None and now - self._asked_at.get(name, float("-inf")) < STATUS_EVERY_S:
                continue
            self._pending[name] = (actor.status.remote(), now)
            self._asked_at[name] = now

    def _answers(self) -> list[tuple[str, Any]]:
        """(name, status dict or the exception Ray raised) for every status call answered by now."""
        import ray
        from ray.exceptions import RayError

        if not self._pending:
            return []
        by_ref = {ref: name for name, (ref, _) in self._pending.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        answers = []
        for ref in ready:
            name = by_ref[ref]
            del self._pending[name]
            try:
                answers.append((name, ray.get(ref)))
            except RayError as exc:  # unavailable, dead, or its call failed: a state of the actor (`_on_status`)
                answers.append((name, exc))
        return answers

    def _slot(self, name: str) -> Slot | None:
        return next((slot for slot in self.slots if slot.name == name), None)

    # ---- what a status says ----------------------------------------------------------------------------

    def _on_status(self, slot: Slot, result: Any, now: float) -> None:
        if isinstance(result, BaseException):
            actor = self._actors.get(slot.name)
            state, death = self.cluster.actor_state(actor) if actor is not None else ("DEAD", "")
            if state == "DEAD":
                self._given_up(slot, death or _first_line(result))
                return
            # Ray is restarting it (or creating it): the process is gone, the next one not yet seen.
            if slot.process is not None and slot.process.returncode is None:
                slot.process.returncode = -1
                slot.state = ChildState.BACKOFF
            return
        incarnation = int(result["incarnation"])
        if incarnation != self._incarnations.get(slot.name):
            self._new_incarnation(slot, result, now)
        if slot is self.syncer and result["address"] and slot.state == ChildState.STARTING:
            self._syncer_serves(result["address"])
        code = result["returncode"]
        if code is not None:
            self._kept_exit(slot, code, result["log_tail"], verdict=result.get("verdict"), reason=result.get("reason"))

    def _new_incarnation(self, slot: Slot, result: dict[str, Any], now: float) -> None:
        incarnation = int(result["incarnation"])
        # First seen after a restart (its first process died before the first status): still restarts to count.
        known = self._incarnations.get(slot.name, 0 if incarnation > 0 else None)
        self._incarnations[slot.name] = incarnation
        if known is not None:
            code = result["previous_exit"]
            how = describe_exit(code) if code is not None else "its Ray actor's death"
            slot.exit_codes.append(code if code is not None else -1)
            if code is not None:
                how = describe_exit_with(code, result["previous_log_tail"])
            self._emit("exited", slot, f"exited with {how}", exit_code=code, log_tail=result["previous_log_tail"])
            for _ in range(incarnation - known):  # Ray may have restarted it more than once
                slot.restarts += 1
                self._emit("restart_scheduled", slot, f"restarted by Ray (restart {slot.restarts})", delay_s=0.0,
                           restarts=slot.restarts)
        slot.process = RemoteProcess(pid=int(result["pid"]), node=str(result["node"]), started_at=now)  # type: ignore[assignment]
        slot.pids.append(slot.process.pid)
        slot.state = ChildState.STARTING if slot is self.syncer else ChildState.RUNNING  # syncer: until it serves
        self._emit("started", slot, f"started (pid {slot.process.pid} on {slot.process.node}, Ray actor pid "
                   f"{result['worker_pid']})", pid=slot.process.pid, restarts=slot.restarts, node=slot.process.node)

    def _syncer_serves(self, address: str) -> None:
        """A syncer process (the first, or a restarted one) serves at `address`."""
        moved = self.syncer_address is not None and address != self.syncer_address
        self.syncer_address = address
        self.syncer.state = ChildState.RUNNING
        self._emit("address", self.syncer, f"serving on {address}", address=address)
        if moved:  # learners were told the old address: Ray restarts them, and they ask the syncer again
            import ray

            for slot in self._learner_slots:
                if slot.name in self._actors and not slot.state.final:
                    ray.kill(self._actors[slot.name], no_restart=False)

    def _kept_exit(self, slot: Slot, code: int, tail: list[str], *, verdict: str | None = None,
                   reason: str | None = None) -> None:
        """An exit the actor keeps (done, refused, usage error; a learner done before it crashed, or given up after
        starts that ended before their session: `verdict`): the role is over; its actor is ended."""
        assert slot.process is not None
        slot.process.returncode = code
        slot.exit_codes.append(code)
        last = reason_line(tail) if tail else describe_exit(code)
        if verdict == "done":
            slot.state = ChildState.DONE
            self._emit("done", slot, f"exited with {describe_exit(code)} {DONE_AFTER_SESSION}", exit_code=code,
                       log_tail=tail)
        elif verdict == "failed":
            slot.state, slot.reason = ChildState.FAILED, reason or last
            self._emit("failed", slot, f"failed: {slot.reason}", exit_code=code, reason=slot.reason)
        elif slot is self.syncer:
            slot.state, slot.reason = ChildState.FAILED, last
            self.failure = f"the syncer cannot run: {last}"
            self._emit("failed", slot, self.failure, exit_code=code)
        elif code == EXIT_DONE:
            slot.state = ChildState.DONE
            self._emit("done", slot, "exited (done)", exit_code=code)
        elif code == EXIT_REFUSED:
            last = refusal_reason(tail) if tail else last
            slot.state, slot.reason = ChildState.REFUSED, last
            self._emit("refused", slot, f"refused by the syncer: {last}", exit_code=code, reason=last)
        else:
            slot.state, slot.reason = ChildState.FAILED, last
            self._emit("failed", slot, f"failed: {last}", exit_code=code, reason=last)
        self._end_actor(slot)

    def _given_up(self, slot: Slot, reason: str) -> None:
        """Ray will not restart it (max_restarts spent, or its creation failed)."""
        if slot.process is not None and slot.process.returncode is None:
            slot.process.returncode = -1
        slot.state, slot.reason = ChildState.FAILED, f"its Ray actor died after {slot.restarts} restarts: {reason}"
        self._actors.pop(slot.name, None)
        if slot is self.syncer:
            self.failure = f"the syncer cannot run: {slot.reason}"
        self._emit("failed", slot, f"failed: {slot.reason}")

    def _end_actor(self, slot: Slot) -> None:
        import ray

        actor = self._actors.pop(slot.name, None)
        self._pending.pop(slot.name, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    # ---- stopping -------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every role that still runs (learners, evaluator, syncer), end every actor, leave Ray."""
        if self._actor_class is not None:
            running = [s for s in self.learners if s.name in self._actors]
            if running:
                self._emit("stopping", None, f"stopping {len(running)} learner(s)")
                self._stop(running, self.config.learner_stop_timeout_s)
            for slot in self.learners:
                if not slot.state.final:
                    slot.state = ChildState.STOPPED
            for slot in ([self.evaluator] if self.evaluator is not None else []) + [self.syncer]:
                if slot.name in self._actors:
                    self._emit("stopping", slot, "stopping")
                    self._stop([slot], self.config.syncer_stop_timeout_s)
                if not slot.state.final:
                    slot.state = ChildState.STOPPED
        self._actor_class = None
        killed = self.cluster.shutdown()
        if killed:
            self._emit("ray", None, f"SIGKILLed Ray processes that outlived ray.shutdown(): {killed}")

    def _stop(self, slots: list[Slot], timeout_s: float) -> None:
        """SIGTERM each slot's process through its actor (all at once), wait for the answers, end the actors."""
        import ray
        from ray.exceptions import RayError

        for slot in [s for s in slots if s.process is None]:
            # Still in its constructor (waiting for the syncer's address): ending it is enough; a process it
            # started in the meantime gets SIGTERM with it (PR_SET_PDEATHSIG).
            self._end_actor(slot)
        slots = [s for s in slots if s.process is not None]
        calls = {slot.name: self._actors[slot.name].stop.remote(timeout_s) for slot in slots}
        deadline = time.monotonic() + timeout_s + STOP_MARGIN_S
        waiting = list(calls.values())
        while waiting and time.monotonic() < deadline and not self._kill_now:
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=WAIT_POLL_S)
        if self._kill_now:
            self._kill_groups(slots)
        for slot in slots:
            try:
                code = ray.get(calls[slot.name], timeout=0)
            except RayError:  # a dead, restarting or unanswering actor: its process goes with the actor
                code = None
            if slot.process is not None:
                slot.process.returncode = code if code is not None else -1
            self._end_actor(slot)
            if self._finished_session(slot):
                slot.state = ChildState.DONE
                self._emit("stopped", slot, f"stopped (exit {code}) {STOPPED_AFTER_SESSION}", exit_code=code)
            else:
                self._emit("stopped", slot, f"stopped (exit {code})", exit_code=code)

    def _finished_session(self, slot: Slot) -> bool:
        """A learner whose process, the one the stop ended, had finished its session (its status file says done): the
        stop found it done, on its way out (`learner_exits.finished_session`)."""
        if slot.learner_id is None or slot.process is None:
            return False
        since = started_wall(slot.process.started_at)  # when the driver first saw it: after it started, before done
        return finished_session(status_since(self.paths.learner_status(slot.learner_id), since))

    def _kill_groups(self, slots: list[Slot]) -> None:
        """A second Ctrl-C: SIGKILL the process groups at once where they are this machine's (a local instance);
        elsewhere ending the actors SIGTERMs them (`PR_SET_PDEATHSIG`)."""
        if not self.cluster.started_local:
            return
        for slot in slots:
            if slot.process is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(slot.process.pid, signal.SIGKILL)

    def _emit(self, kind: str, slot: Slot | None, message: str, **fields: Any) -> None:
        name = slot.name if slot is not None else "run"
        learner_id = slot.learner_id if slot is not None else None
        logger.info("[%s] %s", name, message)
        self._on_event(Event(kind, name, learner_id, message, fields))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

