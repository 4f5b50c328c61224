"""Running one system under a fault plan on this machine: the per-system drivers.

A chaos run executes the same `FaultPlan` against each system in turn (Decoupled DiLoCo, synchronous
DiLoCo, data-parallel), each for `plan.duration_s` of wall time counted from the moment the system
is training (every learner has taken an inner step; the first data-parallel step), so that start-up
(process start, torch import) shifts no fault and costs no system allocated time.

The faults are carried out, and recorded in `SYSTEM_DIR/chaos/faults.jsonl`, by the `FaultInjector`
(`ddiloco.chaos.fault_injector`), which each driver polls in one loop with its system, through the system's
`Targets`. `SYSTEM_DIR/chaos/run.json` records the launch time, the stop request (the end of the measured
window), the time everything had stopped, every pid started (standby processes included), any process still
alive after the stop, and the signal that cut the system short, if one did: a Ctrl-C, SIGTERM or SIGHUP
(`ddiloco.interrupts`) unwinds the driver, which lifts every fault and stops every process as at the plan's end,
writes that record and lets the interrupt go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco import interrupts
from ddiloco.chaos.fault_injector import FaultInjector
from ddiloco.chaos.plan import FaultPlan
from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.checks import invalid
from ddiloco.fault_control import control_path
from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.run_paths import RunPaths

if TYPE_CHECKING:
    from ddiloco.chaos.data_parallel import DataParallelJob
    from ddiloco.run_config import RunConfig
    from ddiloco.runtime.supervised_roles import Slot
    from ddiloco.runtime.supervisor import Supervisor

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
    from ddiloco.runtime.supervised_roles import Event, SupervisorConfig
    from ddiloco.runtime.supervisor import Supervisor

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
