"""Running one system under a fault plan on this machine: the injector and the per-system drivers.

A chaos run executes the same `FaultPlan` against each system in turn (Decoupled DiLoCo, synchronous
DiLoCo, data-parallel), each for `plan.duration_s` of wall time counted from the moment the system
is training (every learner has taken an inner step; the first data-parallel step), so that start-up
(process start, torch import) shifts no fault and costs no system allocated time.

The `FaultInjector` turns the plan's faults into real actions at their times:

- process faults with signals to the target's process group: `crash` (SIGKILL; with `restart: false`
  the target is first held down for the fault's duration, like a machine being replaced), `hang`
  (SIGSTOP, SIGCONT at the end; a process two hangs stopped runs again only when the last one in force
  ends), `syncer_crash` (SIGKILL of the syncer; for data-parallel training it is the job's coordinator,
  rank 0, which hosts the rendezvous store);
- in-process faults (`partition`, `latency`, `bandwidth`, `drop`, `corrupt`, `straggler`) through
  the target's control file (`ddiloco.fault_control`), which the target's transport and training
  loop obey. A partitioned data-parallel rank is also held: the job cannot restart without it.

Every executed fault is written to `SYSTEM_DIR/chaos/faults.jsonl` when it fires (so a crashed
runner still leaves the record), with its planned end; the file is rewritten when a fault is lifted
and at the stop, so that "ended" is when the fault actually ended: a hang's SIGCONT, an in-process
fault's removal, or the stop for any fault (a held-down crash included) that would have outlived the
run. And `SYSTEM_DIR/chaos/run.json` records the launch time, the stop
request (the end of the measured window), the time everything had stopped, every pid started (standby
processes included), any process still alive after the stop, and the signal that cut the system short, if
one did: a Ctrl-C, SIGTERM or SIGHUP (`ddiloco.interrupts`) unwinds the driver, which lifts every fault
and stops every process as at the plan's end, writes that record and lets the interrupt go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddiloco import interrupts
from ddiloco.chaos.plan import Fault, FaultPlan
from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.checks import invalid
from ddiloco.fault_control import IN_PROCESS_KINDS, ActiveFault, control_path, write_control
from ddiloco.runtime.launcher import RunPaths, process_group_alive

if TYPE_CHECKING:
    from ddiloco.chaos.data_parallel import DataParallelJob
    from ddiloco.run_config import RunConfig
    from ddiloco.runtime.supervisor import Slot, Supervisor

logger = logging.getLogger(__name__)

SYSTEMS = ("decoupled", "data_parallel", "sync_diloco")
"""Every system `ddiloco chaos` can run, in the order it runs them."""
RUNTIME_SYSTEMS = ("decoupled", "sync_diloco")
"""Systems run by the real ddiloco runtime (a syncer and learner processes)."""
POLL_S = 0.1
"""The one loop interval of a chaos run: fault times are kept to about this."""
PROGRESS_EVERY_S = 10.0
SYNCER = "syncer"
STANDBY_RESTARTS = 2
"""Under chaos each system keeps warm standby processes for this many restarts: a second crash soon after
a first (before the used standbys' replacements have imported torch) still finds them. A runtime restart
replaces one learner, a data-parallel restart all M ranks."""


class Targets(Protocol):
    """What the injector needs from a running system."""

    def pids(self, target: str) -> list[int]:
        """Process group ids of the target's live processes (each child leads its own group)."""
        ...

    def hold(self, target: str, until: float) -> None:
        """Keep the target from being restarted before wall time `until`."""
        ...

    def control_file(self, target: str) -> Path:
        ...

    def partitioned(self, target: str, until: float) -> None:
        """The target is cut off until wall time `until` (data-parallel: the job cannot restart without it)."""
        ...


@dataclass
class _Lift:
    at: float
    target: str
    fault: Fault
    record: dict[str, Any]
    """The fault's entry in the log, whose "ended" the lift sets."""
    pids: list[int] = field(default_factory=list)
    active: ActiveFault | None = None


class FaultInjector:
    """Carries out a plan against one running system. Call `start(t0)`, then `tick()` often, then `finish()`."""

    def __init__(self, plan: FaultPlan, targets: Targets, log_path: Path, *,
                 clock: Callable[[], float] = time.time, say: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.targets = targets
        self.log_path = Path(log_path)
        self.clock = clock
        self.say = say
        self.t0: float | None = None
        self._due = list(enumerate(plan.faults))
        self._lifts: list[_Lift] = []
        self._active: dict[str, list[ActiveFault]] = {}
        self.executed: list[dict[str, Any]] = []

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")

    def tick(self) -> None:
        assert self.t0 is not None, "start() first"
        now = self.clock()
        for lift in [lift for lift in self._lifts if lift.at <= now]:
            self._lift(lift, now)
        while self._due and self.t0 + self._due[0][1].at_s <= now:
            index, fault = self._due.pop(0)
            self._fire(index, fault, now)

    def finish(self, at: float | None = None) -> None:
        """Lift every fault still in force (a stopped process must not stay stopped), end the record of every
        fault that would have outlived the run at the stop, wall time `at` (default: now), and record the
        faults the run did not reach."""
        stop = self.clock() if at is None else at
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # a run stopped before its plan started: no start()
        for lift in list(self._lifts):
            if lift.at > stop:
                lift.record["note"] = _join(lift.record["note"], "cut short by the stop")
            self._lift(lift, stop)
        for record in self.executed:
            if record["ended"] is not None and record["ended"] > stop:  # a crash held down past the stop
                record["ended"] = max(record["started"], stop)
                record["note"] = _join(record["note"], "cut short by the stop")
        for index, fault in self._due:
            self._record(index, fault, started=None, ended=None, pids=[], note="not reached: the run ended first")
        self._due = []
        self._write_log()

    # ---- firing and lifting ------------------------------------------------------------------------

    def _fire(self, index: int, fault: Fault, now: float) -> None:
        target = fault.target_name
        end = now + fault.duration_s
        pids: list[int] = []
        note = ""
        if fault.kind in ("crash", "syncer_crash"):
            if fault.kind == "crash" and not fault.restart:
                self.targets.hold(target, end)
            pids = self.targets.pids(target)
            self._signal(pids, signal.SIGKILL)
            if fault.kind == "syncer_crash" or fault.restart:
                end = now
        elif fault.kind == "hang":
            pids = self.targets.pids(target)
            self._signal(pids, signal.SIGSTOP)
        elif fault.kind in IN_PROCESS_KINDS:
            active = ActiveFault(fault.kind, end, fault.value)
            self._active.setdefault(target, []).append(active)
            write_control(self.targets.control_file(target), self._active[target])
            if fault.kind == "partition":
                self.targets.partitioned(target, end)
        else:  # FaultPlan validates kinds; a new kind must be taught here
            raise ValueError(f"fault kind {fault.kind!r} has no injector")
        if not pids and fault.kind in ("crash", "syncer_crash", "hang"):
            note = f"{target} was not running: nothing to signal"
        record = self._record(index, fault, started=now, ended=end, pids=pids, note=note)
        if fault.kind == "hang":
            self._lifts.append(_Lift(end, target, fault, record, pids=pids))
        elif fault.kind in IN_PROCESS_KINDS:
            self._lifts.append(_Lift(end, target, fault, record, active=active))
        offset = now - (self.t0 or now)
        suffix = f"  ({note})" if note else ""
        self.say(f"  t={offset:6.1f} s  {fault.kind:<12} {target:<10} {_describe(fault)}{suffix}")

    def _lift(self, lift: _Lift, now: float) -> None:
        self._lifts.remove(lift)
        if lift.fault.kind == "hang":
            # Hangs may overlap: a process another hang in force stopped stays stopped until that one ends.
            held = {pid for other in self._lifts if other.fault.kind == "hang" for pid in other.pids}
            self._signal([pid for pid in lift.pids if pid not in held], signal.SIGCONT)
        elif lift.active is not None:
            remaining = [a for a in self._active.get(lift.target, []) if a is not lift.active]
            self._active[lift.target] = remaining
            write_control(self.targets.control_file(lift.target), remaining)
        lift.record["ended"] = now
        self._write_log()

    @staticmethod
    def _signal(pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)

    def _record(self, index: int, fault: Fault, *, started: float | None, ended: float | None, pids: list[int],
                note: str) -> dict[str, Any]:
        entry = {"index": index, "kind": fault.kind, "target": fault.target_name, "at_s": fault.at_s,
                 "duration_s": fault.duration_s, "restart": fault.restart, "value": fault.value,
                 "started": started, "ended": ended, "pids": pids, "note": note}
        self.executed.append(entry)
        self._write_log()
        return entry

    def _write_log(self) -> None:
        """Rewrite the log whole (temp file + rename: a reader, or a runner killed meanwhile, never leaves half)."""
        tmp = self.log_path.with_name(self.log_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(entry) + "\n" for entry in self.executed), encoding="utf-8")
        os.replace(tmp, self.log_path)


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def _describe(fault: Fault) -> str:
    parts = []
    if fault.duration_s:
        parts.append(f"for {fault.duration_s:g} s")
    if fault.kind == "crash":
        parts.append("supervisor restarts it" if fault.restart else "held down")
    if fault.value is not None:
        parts.append({"straggler": "x{:g}", "latency": "+{:g} s", "bandwidth": "{:.3g} B/s"}.get(
            fault.kind, "p={:g}").format(fault.value))
    return ", ".join(parts)


# ---- the ddiloco runtime under chaos (Decoupled DiLoCo and synchronous DiLoCo) -------------------------


class RuntimeTargets:
    """Targets of a `ddiloco run`-style system: the supervisor's syncer and learner slots."""

    def __init__(self, supervisor: Supervisor, paths: RunPaths) -> None:
        self.supervisor = supervisor
        self.paths = paths

    def _slot(self, target: str) -> Slot:
        if target == SYNCER:
            return self.supervisor.syncer
        return self.supervisor.learners[int(target.rpartition("-")[2])]

    def pids(self, target: str) -> list[int]:
        pid = self._slot(target).pid
        return [] if pid is None else [pid]

    def hold(self, target: str, until: float) -> None:
        self.supervisor.hold(self._slot(target), time.monotonic() + (until - time.time()))

    def control_file(self, target: str) -> Path:
        return control_path(self.paths.learner_dir(int(target.rpartition("-")[2])))

    def partitioned(self, target: str, until: float) -> None:
        pass  # the learner keeps running and reconnects by itself


@dataclass(frozen=True, kw_only=True)
class ChaosSettings:
    """How each system is run under chaos (the plan says what happens to it)."""

    threads: int = 1
    """torch threads per learner / rank."""
    eval_every_s: float = 5.0
    """Validation loss period of the syncer and of data-parallel rank 0."""
    ready_timeout_s: float = 180.0
    """Longest wait for a system to start training before the plan's clock starts anyway."""
    dp_checkpoint_every_s: float = 20.0
    """Data-parallel checkpoint period (wall seconds of training)."""
    dp_hang_timeout_s: float = 10.0
    """A data-parallel rank without a step for this long has failed (the job restarts)."""
    watchdog_s: float | None = None
    """A runtime system that commits no round for this long fails (the soak's watchdog); None: no watchdog."""
    warm_restarts: bool = True
    """Restarts run in warm standby processes (`ddiloco.runtime.standby`), enough for `STANDBY_RESTARTS`
    restarts: the runtime keeps that many standby learners and a standby syncer that takes over a killed
    syncer (`ddiloco.runtime.syncer_standby`), the data-parallel agent that many times M standby ranks.
    False: every restart is a cold start."""

    def __post_init__(self) -> None:
        if self.watchdog_s is not None and not self.watchdog_s > 0:
            raise invalid("watchdog_s", self.watchdog_s, "seconds > 0")
        for name in ("eval_every_s", "ready_timeout_s", "dp_checkpoint_every_s", "dp_hang_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected a number > 0 (seconds)")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} is invalid: expected an integer >= 1")


def unbounded(run_config: RunConfig) -> RunConfig:
    """A chaos run ends at its plan's duration, not at an inner-step budget: no learner or rank finishes on its own,
    and none starts the learning rate's cooldown (`InnerConfig.cooldown`), which every system would reach at a
    different time. The warm-up, counted in steps, runs as in any run."""
    return dataclasses.replace(run_config, inner_steps=10**9)


def runtime_config(run_config: RunConfig, system: str) -> RunConfig:
    """The run config of a runtime system (`unbounded`): synchronous DiLoCo waits for every live learner (K = M,
    no grace)."""
    config = unbounded(run_config)
    if system == "sync_diloco":
        config = dataclasses.replace(config, quorum=dataclasses.replace(
            config.quorum, min_quorum=config.num_learners, grace="none"))
    return config


def _runtime_ready(paths: RunPaths, num_learners: int) -> bool:
    for learner_id in range(num_learners):
        status = read_json_object(paths.learner_status(learner_id)) or {}
        if int(status.get("inner_step") or 0) < 1:
            return False
    return True


def run_runtime_system(system: str, system_dir: Path, run_config: RunConfig, plan: FaultPlan, settings: ChaosSettings,
                       *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run Decoupled DiLoCo (or synchronous DiLoCo) under `plan`; returns the run.json record."""
    from ddiloco.metrics import JsonlSink
    from ddiloco.runtime.launcher import LaunchConfig, Launcher
    from ddiloco.runtime.report import write_report
    from ddiloco.runtime.supervisor import Event, Supervisor, SupervisorConfig

    config = runtime_config(run_config, system)
    system_dir.mkdir(parents=True, exist_ok=False)
    paths = RunPaths(system_dir)
    config.save(paths.config)
    launcher = Launcher(LaunchConfig(run_dir=system_dir, num_learners=config.num_learners, threads=settings.threads,
                                     chaos_control=True, eval_every_s=settings.eval_every_s,
                                     seed=config.seed, round_files="all"))  # audited from the genesis
    sink = JsonlSink(paths.launcher_metrics)

    def on_event(event: Event) -> None:
        sink.event(event.kind, name=event.name, learner_id=event.learner_id, message=event.message, **event.fields)
        if event.kind in ("exited", "restart_scheduled", "failed", "refused"):
            say(f"  [{system}] {event.name} {event.message}")

    supervisor = Supervisor(SupervisorConfig(standby_learners=STANDBY_RESTARTS if settings.warm_restarts else 0,
                                             standby_syncer=settings.warm_restarts),
                            launcher=launcher, on_event=on_event)
    injector = FaultInjector(plan, RuntimeTargets(supervisor, paths), system_dir / "chaos" / "faults.jsonl", say=say)
    watchdog = CommitWatchdog(paths.root / "rounds.jsonl", settings.watchdog_s)
    failure = lambda: supervisor.failure or watchdog.check()  # noqa: E731
    started = time.time()
    interrupted: str | None = None
    try:
        supervisor.start()
        _wait_ready(lambda: _runtime_ready(paths, config.num_learners), supervisor.poll, settings, system, say,
                    failed=lambda: supervisor.failure)
        watchdog.start()
        _drive(injector, plan, system, step=supervisor.poll, failed=failure,
               status=lambda: _runtime_status(paths), say=say)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM or SIGHUP (`interrupts.stop_signals_raise`)
        interrupted = interrupts.signal_of(interrupt).name
        raise
    finally:
        stop_requested = time.time()
        _stop(injector, stop_requested, supervisor.shutdown, sink.close)
        if interrupted is not None:
            _write_run_record(system_dir, system, config.num_learners, started, stop_requested, time.time(),
                              supervisor.pids, t0=injector.t0, failure=None, interrupted=interrupted)
    ended = time.time()
    final_states = {s.learner_id: (str(s.state), s.reason) for s in supervisor.learners}
    write_report(paths, num_learners=config.num_learners, outcome="completed", wall_time_s=ended - started,
                 final_states=final_states, failure=failure())
    return _write_run_record(system_dir, system, config.num_learners, started, stop_requested, ended,
                             supervisor.pids, t0=injector.t0, failure=failure(),
                             longest_commit_gap_s=watchdog.longest_gap_s)


class CommitWatchdog:
    """A run that stops committing rounds fails: no new round-log line for `limit_s` (None: never) is the
    failure "no round committed for ...". Also keeps the longest gap between commits it saw."""

    def __init__(self, log: Path, limit_s: float | None) -> None:
        self.log = log
        self.limit_s = limit_s
        self.longest_gap_s = 0.0
        self._size = -1
        self._since: float | None = None
        self.fired: str | None = None

    def start(self) -> None:
        self._since = time.monotonic()

    def check(self) -> str | None:
        if self._since is None or self.fired is not None:
            return self.fired
        now = time.monotonic()
        size = self.log.stat().st_size if self.log.exists() else 0
        if size != self._size:
            self._size, self._since = size, now
        self.longest_gap_s = max(self.longest_gap_s, now - self._since)
        if self.limit_s is not None and now - self._since > self.limit_s:
            self.fired = f"watchdog: no round committed for {self.limit_s:g} s"
        return self.fired


def _runtime_status(paths: RunPaths) -> str:
    status = read_json_object(paths.syncer_status) or {}
    loss = (read_json_object(paths.evaluator_status) or {}).get("val_loss")
    return (f"rounds {status.get('rounds_committed', 0)}, alive learners {status.get('alive_learners', '?')}, "
            f"val loss {loss:.3f}" if isinstance(loss, int | float) else
            f"rounds {status.get('rounds_committed', 0)}, alive learners {status.get('alive_learners', '?')}")


# ---- shared loop -------------------------------------------------------------------------------------


def _stop(injector: FaultInjector, at: float, *stops: Callable[[], None]) -> None:
    """End a system, however its run ended (a Ctrl-C or SIGTERM before its plan started included): lift every
    fault, whole (`interrupts.deferred`: a second signal must not leave a SIGSTOPped process stopped for good),
    then stop its processes, even if the lift failed."""
    with contextlib.ExitStack() as cleanup:
        for stop in reversed(stops):
            cleanup.callback(stop)
        with interrupts.deferred():
            injector.finish(at=at)


def _wait_ready(ready: Callable[[], bool], step: Callable[[], None], settings: ChaosSettings, system: str,
                say: Callable[[str], None], *, failed: Callable[[], str | None]) -> None:
    deadline = time.monotonic() + settings.ready_timeout_s
    while not ready():
        if failed():
            raise RuntimeError(f"{system} could not start: {failed()}")
        if time.monotonic() > deadline:
            say(f"  [{system}] not every process was training after {settings.ready_timeout_s:.0f} s; "
                "starting the plan anyway")
            return
        step()
        time.sleep(POLL_S)


def _drive(injector: FaultInjector, plan: FaultPlan, system: str, *, step: Callable[[], None],
           failed: Callable[[], str | None], status: Callable[[], str], say: Callable[[str], None]) -> None:
    t0 = time.time()
    injector.start(t0)
    say(f"  [{system}] training: plan clock started ({plan.duration_s:g} s, {len(plan.faults)} faults)")
    next_progress = t0 + PROGRESS_EVERY_S
    while time.time() < t0 + plan.duration_s:
        step()
        injector.tick()
        if failed():
            say(f"  [{system}] the run cannot go on: {failed()}")
            return
        if time.time() >= next_progress:
            say(f"  [{system}] t={time.time() - t0:5.0f} s  {status()}")
            next_progress += PROGRESS_EVERY_S
        time.sleep(POLL_S)


def _write_run_record(system_dir: Path, system: str, num_learners: int, started: float, stop_requested: float,
                      ended: float, pids: list[int], *, t0: float | None, failure: str | None,
                      longest_commit_gap_s: float | None = None, interrupted: str | None = None) -> dict[str, Any]:
    """Write SYSTEM_DIR/chaos/run.json; `interrupted` names the signal that cut the system short (None: it ran to its
    end or its failure)."""
    left_behind = [pid for pid in pids if process_group_alive(pid)]
    record = {"system": system, "num_learners": num_learners, "started": started,
              "stop_requested": stop_requested, "ended": ended, "plan_started": t0, "pids": pids,
              "left_behind": left_behind, "failure": failure, "longest_commit_gap_s": longest_commit_gap_s,
              "interrupted": interrupted}
    atomic_write_json(system_dir / "chaos" / "run.json", record)
    return record


# ---- synchronous data-parallel training under chaos ----------------------------------------------------


class DataParallelTargets:
    """Targets of the data-parallel job: learner-N is rank N; the syncer's counterpart is rank 0, the
    coordinator that hosts the job's rendezvous store."""

    def __init__(self, job: DataParallelJob) -> None:
        self.job = job

    @staticmethod
    def rank(target: str) -> int:
        return 0 if target == SYNCER else int(target.rpartition("-")[2])

    def pids(self, target: str) -> list[int]:
        pid = self.job.pids().get(self.rank(target))
        return [] if pid is None else [pid]

    def hold(self, target: str, until: float) -> None:
        self.job.hold(self.rank(target), until)

    def control_file(self, target: str) -> Path:
        return self.job.control_file(self.rank(target))

    def partitioned(self, target: str, until: float) -> None:
        self.job.hold(self.rank(target), until)  # the job cannot re-form without that rank


def run_data_parallel_system(system_dir: Path, run_config: RunConfig, plan: FaultPlan, settings: ChaosSettings,
                             *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the DDP baseline under `plan`; returns the run.json record."""
    from ddiloco.chaos.data_parallel import DataParallelAgentConfig, DataParallelJob

    system_dir.mkdir(parents=True, exist_ok=False)
    standby_ranks = STANDBY_RESTARTS * run_config.num_learners if settings.warm_restarts else 0
    job = DataParallelJob(DataParallelAgentConfig(threads=settings.threads, eval_every_s=settings.eval_every_s,
                                             checkpoint_every_s=settings.dp_checkpoint_every_s,
                                             hang_timeout_s=settings.dp_hang_timeout_s,
                                             standby_ranks=standby_ranks),
                          run_config=unbounded(run_config), job_dir=system_dir)
    injector = FaultInjector(plan, DataParallelTargets(job), system_dir / "chaos" / "faults.jsonl", say=say)
    seen: list[int] = []

    def step() -> None:
        job.poll()
        seen.extend(pid for pid in job.pids().values() if pid not in seen)

    def stop_job() -> None:
        if job.started:
            job.stop()

    started = time.time()
    interrupted: str | None = None
    try:
        job.start()
        _wait_ready(lambda: job.training_started_at is not None, step, settings, "data_parallel", say,
                    failed=lambda: job.failure)
        _drive(injector, plan, "data_parallel", step=step, failed=lambda: job.failure,
               status=lambda: f"step {job.step}, failures {job.failures}", say=say)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM or SIGHUP (`interrupts.stop_signals_raise`)
        interrupted = interrupts.signal_of(interrupt).name
        raise
    finally:
        stop_requested = time.time()
        _stop(injector, stop_requested, stop_job)
        pids = seen + [pid for pid in job.standby_pids if pid not in seen]
        if interrupted is not None:
            _write_run_record(system_dir, "data_parallel", run_config.num_learners, started, stop_requested,
                              time.time(), pids, t0=injector.t0, failure=None, interrupted=interrupted)
    ended = time.time()
    return _write_run_record(system_dir, "data_parallel", run_config.num_learners, started, stop_requested, ended,
                             pids, t0=injector.t0, failure=job.failure)
