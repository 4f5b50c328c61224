"""The synchronous data-parallel baseline as a job: M rank processes and the agent that restarts them.

`DataParallelJob` is what a torchrun elastic agent does for an ordinary (non-elastic) DDP job on one
machine: start every rank (`ddiloco.chaos.dp_worker`), watch them, and when anything fails restart the
whole job from its last checkpoint, since synchronous training needs all M ranks. A failure is:

- a rank exits, with any code or signal (its exit codes are `dp_common.EXIT_MEANINGS`);
- a rank shows no step progress for `hang_timeout_s` (its heartbeat, `ranks/R/status.json`, is rewritten
  every step), or does not reach its first step within `start_timeout_s` of its start. In lockstep every
  rank stalls when one does, so the failure names the rank(s) to blame: a process without signs of life
  (`ranks/R/alive`, touched by a thread every 0.25 s: a SIGSTOPped or frozen process), else a rank stalled
  outside any collective (a partitioned rank), else every rank;
- the gloo timeout fires inside a rank (it then exits with `dp_common.EXIT_COLLECTIVE_FAILED`).

On a failure the agent logs it, SIGKILLs every rank's process group (and sends SIGCONT, in case a chaos run
had SIGSTOPped one), waits until no rank is held (`hold`: a replica that is unavailable, such as a machine
being replaced or a partition that has not healed) and starts every rank again: a new attempt, its ranks in
waiting standby processes where `standby_ranks` keeps some (`ddiloco.runtime.standby`: interpreter start and
torch import already done), else cold. Nothing of the restart is assumed: the process start or hand-over,
rendezvous, gloo connection and checkpoint load take what they take, and the "training" event records it
(`start_s`).

The agent runs inside its caller's process and never blocks for long: `start()`, then `poll()` every
`poll_s` (from the chaos runner's one loop, next to fault injection), then `stop()`; `run(duration_s)` does
all three for tests. Ranks die with the agent's thread (PR_SET_PDEATHSIG, set by `ddiloco.runtime.launcher`,
which also gives each rank its own process group and log file).

Files in the job directory DIR (`dp_common.JobPaths`):

- `config.json`: the RunConfig every rank reads.
- `metrics.jsonl`: the agent's events ({"event", "time", ...}): "attempt_start" {attempt, from_step, pids},
  "training" {attempt, from_step, start_s} (every rank has taken a step), "failure" {attempt, rank, cause},
  "held" {rank, until}, "checkpoint" {attempt, step} (when the agent sees a new durable checkpoint),
  "gave_up" {attempt, reason} (MAX_FAILED_STARTS broken starts in a row), "stopped" {attempt, step}.
- `ranks/R/metrics.jsonl`: per step {"step" (global step after it), "time", "dp/R/loss", "dp/R/step_s",
  "attempt"}; rank 0 also {"step", "time", "dp/val_loss", "attempt"}. `ranks/R/status.json`: the heartbeat.
- `checkpoints/`: `ddiloco.checkpoint` states, serial = global step.
- `logs/rank-R-attempt-A.log`: each rank's output, per attempt.
- `summary.json` (written by `stop()`): attempts, failures, final_step (the step of the last durable
  checkpoint: the model the job ends with), steps_computed (global steps computed over all attempts,
  including those rolled back), steps_kept, steps_rolled_back (`ddiloco.data_parallel.account_steps`),
  grad_bytes (one rank's gradient), allreduce_bytes (computed, not measured: steps_computed x M x
  `ddiloco.data_parallel.ring_allreduce_bytes` of grad_bytes, what the ranks of a ring all-reduce send in
  total), final_val_loss (rank 0's last), start_s (per attempt: launch to every rank's first step),
  gave_up (the reason, or null), wall_time_s (start() to the end of stop()).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.chaos.dp_common import EXIT_MEANINGS, JobPaths, RankConfig, committed_steps
from ddiloco.checkpoint import atomic_write_json, read_json
from ddiloco.checks import invalid, require_int
from ddiloco.data_parallel import StepAccount, account_steps, ring_allreduce_bytes
from ddiloco.metrics import JsonlSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.child_process import ChildProcess, stop_processes
from ddiloco.runtime.launcher import LOOPBACK, LaunchConfig, Launcher
from ddiloco.runtime.learner_exits import describe_exit
from ddiloco.runtime.standby import TORCH_LAZY, StandbyPool

logger = logging.getLogger(__name__)

WORKER_MODULE = "ddiloco.chaos.dp_worker"
COLLECTIVE_TIMEOUT_FACTOR = 1.5
"""gloo's timeout is this multiple of hang_timeout_s: slightly later than the agent's own no-progress check, so
a rank that hangs is reported as hung rather than as the peer that timed out waiting for it. gloo's timeout
remains the backstop for a hang the heartbeat cannot show."""
MAX_FAILED_STARTS = 3
"""Consecutive attempts that end before training with a rank's own error (exit code 1: an uncaught exception,
or 2: bad arguments) after which the agent gives up: restarting a broken job would only loop."""
BROKEN_EXIT_CODES = (1, 2)
KILL_WAIT_S = 10.0
"""Longest wait for a SIGKILLed rank to be reaped (the kernel takes milliseconds)."""


@dataclass(frozen=True, kw_only=True)
class DataParallelAgentConfig:
    """How the agent runs and watches the job (what is trained is in the RunConfig). Not to be confused with
    `ddiloco.sim.data_parallel.DataParallelConfig`, what a failure costs a simulated job."""

    threads: int = 1
    """torch threads per rank."""
    eval_every_s: float = 5.0
    """Rank 0 evaluates the validation loss this often (wall seconds of training) and at the end."""
    checkpoint_every_s: float = 20.0
    """Wall seconds of training between checkpoints."""
    hang_timeout_s: float = 10.0
    """A rank without a new step for this long has failed."""
    start_timeout_s: float = 120.0
    """A rank without its first step this long after its start has failed (torch import on a loaded
    machine takes seconds)."""
    stop_timeout_s: float = 10.0
    """`stop()` waits this long after SIGTERM for the ranks' last step and checkpoint, then SIGKILLs."""
    eval_batches: int = 4
    """Validation batches per evaluation (the syncer's default, so both report the same loss)."""
    poll_s: float = 0.1
    """How often `run()` polls (a caller driving `poll()` itself chooses its own interval)."""
    standby_ranks: int = 0
    """Warm rank processes kept waiting (`ddiloco.runtime.standby`: torch and the worker imported); a restart
    runs its ranks in them while they last (`ddiloco chaos` keeps 2 M: two restarts' worth, as it keeps two
    standby learners for the runtime, whose restart replaces one learner)."""

    def __post_init__(self) -> None:
        require_int("standby_ranks", self.standby_ranks, minimum=0)
        if not isinstance(self.threads, int) or self.threads < 1:
            raise invalid("threads", self.threads, "an integer >= 1")
        if not isinstance(self.eval_batches, int) or self.eval_batches < 1:
            raise invalid("eval_batches", self.eval_batches, "an integer >= 1")
        for name in ("eval_every_s", "checkpoint_every_s", "hang_timeout_s", "start_timeout_s", "stop_timeout_s",
                     "poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number of seconds > 0")

    @property
    def collective_timeout_s(self) -> float:
        return COLLECTIVE_TIMEOUT_FACTOR * self.hang_timeout_s


# ---- pure pieces ----------------------------------------------------------------------------------------------


def exit_cause(returncode: int) -> str:
    """A rank's exit status in words: "exit code 3 (a message of the all-reduce was dropped)", "signal SIGKILL"."""
    meaning = EXIT_MEANINGS.get(returncode) if returncode >= 0 else None
    return describe_exit(returncode) + (f" ({meaning})" if meaning else "")


def computed_steps(lines: Iterable[str]) -> set[tuple[int, int]]:
    """(attempt, global step) of every step line ({"step", "attempt", "dp/R/loss"}) in a rank's metrics lines;
    evaluation lines and a torn last line are skipped."""
    steps = set()
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (isinstance(record, dict) and "attempt" in record and "step" in record
                and any(k.startswith("dp/") and k.endswith("/loss") for k in record)):
            steps.add((int(record["attempt"]), int(record["step"])))
    return steps


def job_account(steps: set[tuple[int, int]], from_steps: Mapping[int, int], *, final_step: int) -> StepAccount:
    """`ddiloco.data_parallel.account_steps` of the job's own record, which must be consistent: every attempt
    that logged steps started, after the step it resumed from, and every step of the final model was computed."""
    unknown = sorted({attempt for attempt, _ in steps} - set(from_steps))
    if unknown:
        raise ValueError(f"steps logged by attempt(s) {unknown}, which never started")
    for attempt, step in sorted(steps):
        if step <= from_steps[attempt]:
            raise ValueError(f"attempt {attempt} logged step {step}, before the step {from_steps[attempt]} it "
                             "resumed from")
    account = account_steps(steps, from_steps, final_step=final_step)
    first = from_steps[min(from_steps)] if from_steps else 0
    if account.kept < final_step - first:
        raise ValueError(f"the job ends at step {final_step} but computed only {account.kept} of its steps from "
                         f"step {first}")
    return account


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a new one per attempt, since a killed rank 0's
    port may linger in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


# ---- the job ----------------------------------------------------------------------------------------------------


@dataclass
class _Attempt:
    number: int
    from_step: int
    children: dict[int, ChildProcess]
    launched_at: float
    """Monotonic."""
    progress: dict[int, tuple[int, float]] = field(default_factory=dict)
    """rank -> (last step seen in its heartbeat, monotonic time it was first seen)."""
    start_s: float | None = None
    """Launch to every rank's first step, once that happened."""


class DataParallelJob:
    """Synchronous DDP training with a restart-everything agent (see the module docstring).

    The chaos runner's API while it runs: `pids()`, `hold(rank, until)`, `control_file(rank)`, `running`,
    `finished`, `training_started_at`, `step`."""

    def __init__(self, config: DataParallelAgentConfig, *, run_config: RunConfig, job_dir: str | Path) -> None:
        self.config = config
        self.run_config = run_config
        self.world_size = run_config.num_learners
        self.paths = JobPaths(Path(job_dir))
        self._launcher: Launcher | None = None
        self._standby: StandbyPool | None = None
        self._sink: JsonlSink | None = None
        self._attempts: list[_Attempt] = []
        self._current: _Attempt | None = None
        self._holds: dict[int, float] = {}
        self._logged_checkpoint: int | None = None
        self._grad_bytes = 0
        self.failures = 0
        self._failed_starts = 0
        self.failure: str | None = None
        """Why the agent gave up (a job that cannot start), or None."""
        self.step = 0
        """The highest global step seen in a heartbeat of the current attempt."""
        self.training_started_at: float | None = None
        """Wall time at which every rank first had a step (None before)."""
        self.finished = False
        self._started_at: float | None = None

    # ---- the chaos runner's view ----

    @property
    def started(self) -> bool:
        return self._started_at is not None

    @property
    def running(self) -> bool:
        """True while an attempt's ranks are up (False while the job waits for a hold, or before start)."""
        return self._current is not None

    def pids(self) -> dict[int, int]:
        """rank -> pid (also its process group id) of the current attempt; empty between attempts."""
        if self._current is None:
            return {}
        return {rank: child.pid for rank, child in self._current.children.items()}

    @property
    def standby_pids(self) -> list[int]:
        """Every standby rank process started so far (handed a rank or not)."""
        return list(self._standby.pids) if self._standby is not None else []

    def control_file(self, rank: int) -> Path:
        self._check_rank(rank)
        return self.paths.control(rank)

    def hold(self, rank: int, until: float) -> None:
        """Rank `rank`'s replica is unavailable until wall time `until`: the job cannot restart before then.
        A hold does not fail a running attempt by itself (a partition fails it through its timeout)."""
        self._check_rank(rank)
        if not math.isfinite(until):
            raise invalid("until", until, "a finite wall time")
        self._holds[rank] = max(until, self._holds.get(rank, -math.inf))
        self._event("held", rank=rank, until=self._holds[rank])
        logger.info("[dp agent] rank %d held until %.1f", rank, self._holds[rank])

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is invalid: the job has ranks 0..{self.world_size - 1}")

    # ---- life cycle ----

    def start(self) -> None:
        if self._started_at is not None:
            raise RuntimeError("the job was already started; use a new DataParallelJob")
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.run_config.save(self.paths.config)
        self._launcher = Launcher(LaunchConfig(run_dir=self.paths.root, num_learners=self.world_size,
                                               threads=self.config.threads, use_token=False))
        self._standby = StandbyPool(self._launcher, size=self.config.standby_ranks, name="standby-rank",
                                    preload=(WORKER_MODULE, *TORCH_LAZY), threads=self.config.threads)
        self._started_at = time.monotonic()
        self._start_attempt()

    def poll(self) -> None:
        """Check the ranks once; on a failure kill them all, and restart once no rank is held."""
        if self._started_at is None or self.finished:
            return
        self._log_new_checkpoint()
        attempt = self._current
        if attempt is not None:
            failures = self._find_failures(attempt, time.monotonic())
            if failures:
                for rank, cause in failures:
                    self.failures += 1
                    self._event("failure", attempt=attempt.number, rank=rank, cause=cause)
                    logger.warning("[dp agent | attempt %d] rank %d failed: %s", attempt.number, rank, cause)
                self._kill(attempt)
                self._check_crash_loop(attempt)
        if self._current is None and self.failure is None and not self._held():
            self._start_attempt()
        if self._standby is not None and self.failure is None:
            self._standby.fill()

    def _check_crash_loop(self, attempt: _Attempt) -> None:
        broken = [rank for rank, child in attempt.children.items() if child.returncode in BROKEN_EXIT_CODES]
        if attempt.start_s is not None or not broken:
            self._failed_starts = 0
            return
        self._failed_starts += 1
        if self._failed_starts >= MAX_FAILED_STARTS:
            log = self.paths.logs / f"rank-{broken[0]}-attempt-{attempt.number}.log"
            self.failure = (f"{self._failed_starts} attempts in a row failed before training (rank {broken[0]}: "
                            f"{exit_cause(attempt.children[broken[0]].returncode)}); see {log}")
            self._event("gave_up", attempt=attempt.number, reason=self.failure)
            logger.error("[dp agent] giving up: %s", self.failure)

    def stop(self) -> dict[str, Any]:
        """SIGTERM the ranks (they agree on a last step, evaluate and checkpoint), SIGKILL what is left after
        `stop_timeout_s`; write summary.json and return it."""
        if self._started_at is None:
            raise RuntimeError("the job was never started")
        if self.finished:
            return read_json(self.paths.summary) or {}
        if self._standby is not None:
            self._standby.close()
        attempt = self._current
        if attempt is not None:
            children = list(attempt.children.values())
            for child in children:
                child.signal_group(signal.SIGCONT)
            stop_processes(children, self.config.stop_timeout_s)
            self._current = None
        self._log_new_checkpoint()
        steps = committed_steps(self.paths.checkpoints)
        final_step = steps[-1] if steps else 0
        self._event("stopped", attempt=attempt.number if attempt else self._attempts[-1].number, step=final_step)
        summary = self._summary(final_step)
        atomic_write_json(self.paths.summary, summary)
        if self._sink is not None:
            self._sink.close()
        self.finished = True
        return summary

    def run(self, duration_s: float) -> dict[str, Any]:
        """Start, train for `duration_s` wall seconds counted from the first step, stop; returns the summary.
        Blocking: for tests and scripts (the chaos runner drives `poll()` itself)."""
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise invalid("duration_s", duration_s, "a finite number of seconds > 0")
        self.start()
        try:
            while self.training_started_at is None or time.time() < self.training_started_at + duration_s:
                self.poll()
                if self.failure is not None:
                    break
                time.sleep(self.config.poll_s)
        finally:
            summary = self.stop()
        return summary

    # ---- attempts ----

    def _held(self) -> bool:
        now = time.time()
        return any(until > now for until in self._holds.values())

    def _start_attempt(self) -> None:
        assert self._launcher is not None
        number = len(self._attempts) + 1
        steps = committed_steps(self.paths.checkpoints)
        from_step = steps[-1] if steps else 0
        port = free_port()
        children = {}
        for rank in range(self.world_size):
            name = f"rank-{rank}-attempt-{number}"
            settings = RankConfig(job_dir=self.paths.root, rank=rank, attempt=number, master_port=port,
                                  eval_every_s=self.config.eval_every_s,
                                  checkpoint_every_s=self.config.checkpoint_every_s,
                                  collective_timeout_s=self.config.collective_timeout_s,
                                  start_timeout_s=self.config.start_timeout_s, eval_batches=self.config.eval_batches,
                                  chaos_control=self.paths.control(rank), threads=self.config.threads)
            path = settings.save(self.paths.root / "settings" / f"{name}.json")
            argv = [sys.executable, "-m", WORKER_MODULE, "--settings", str(path)]
            # The Launcher is the one place that starts a child in its own group, with PR_SET_PDEATHSIG and
            # thread-limited OpenMP: reused rather than copied. A waiting standby is the same, imports done.
            assert self._standby is not None
            children[rank] = (self._standby.hand_out(name, argv)
                              or self._launcher.start(name, argv, self.config.threads))
        attempt = _Attempt(number, from_step, children, time.monotonic())
        self._attempts.append(attempt)
        self._current = attempt
        self._event("attempt_start", attempt=number, from_step=from_step,
                    pids={str(rank): child.pid for rank, child in children.items()})
        logger.info("[dp agent | attempt %d] started %d ranks from step %d", number, self.world_size, from_step)

    def _find_failures(self, attempt: _Attempt, now: float) -> list[tuple[int, str]]:
        failures = []
        for rank, child in attempt.children.items():
            returncode = child.poll()
            if returncode is not None:
                failures.append((rank, exit_cause(returncode)))
        if failures:
            return failures
        waiting = set()
        for rank in attempt.children:
            status = read_json(self.paths.rank_status(rank)) or {}
            if status.get("attempt") != attempt.number or status.get("phase") != "training":
                continue
            if status.get("waiting_since") is not None:
                waiting.add(rank)
            step = int(status["step"])
            seen = attempt.progress.get(rank)
            if step > attempt.from_step and (seen is None or seen[0] != step):
                attempt.progress[rank] = (step, now)
            self._grad_bytes = int(status.get("grad_bytes") or self._grad_bytes)
        if attempt.start_s is None and len(attempt.progress) == self.world_size:
            attempt.start_s = now - attempt.launched_at
            if self.training_started_at is None:
                self.training_started_at = time.time()
            self._event("training", attempt=attempt.number, from_step=attempt.from_step, start_s=attempt.start_s)
        if attempt.progress:
            self.step = max(step for step, _ in attempt.progress.values())
        hung = []
        for rank in attempt.children:
            seen = attempt.progress.get(rank)
            if seen is None and now - attempt.launched_at > self.config.start_timeout_s:
                failures.append((rank, f"no first step within {self.config.start_timeout_s:g} s of its start"))
            elif seen is not None and now - seen[1] > self.config.hang_timeout_s:
                hung.append(rank)
        if hung:
            for rank, why in self._blame(attempt, waiting):
                seen = attempt.progress.get(rank)
                last = f"last step {seen[0]}" if seen else "no step yet"
                failures.append((rank, f"no progress for {self.config.hang_timeout_s:g} s ({last}, {why})"))
        return failures

    def _blame(self, attempt: _Attempt, waiting: set[int]) -> list[tuple[int, str]]:
        """Which ranks hung, once one has made no progress for hang_timeout_s. In lockstep all stop when one
        does, so the agent looks further: a process that no longer shows signs of life (stopped, frozen) hung;
        else a rank outside any collective (stalled) hung and the others wait for it; else it cannot tell."""
        stale_after_s = self.config.hang_timeout_s / 2
        now = time.time()
        silent = []
        for rank in attempt.children:
            try:
                silent_s = now - self.paths.rank_alive(rank).stat().st_mtime
            except FileNotFoundError:
                silent_s = math.inf
            if silent_s > stale_after_s:
                silent.append(rank)
        if silent:
            return [(rank, "process unresponsive") for rank in silent]
        stalled = [rank for rank in attempt.children if rank not in waiting]
        if stalled:
            return [(rank, "outside any collective") for rank in stalled]
        return [(rank, "waiting in a collective") for rank in attempt.children]

    def _kill(self, attempt: _Attempt) -> None:
        """SIGKILL every rank's group (SIGCONT too: a stopped process is killed only once it runs) and reap."""
        for child in attempt.children.values():
            child.signal_group(signal.SIGKILL)
            child.signal_group(signal.SIGCONT)
        deadline = time.monotonic() + KILL_WAIT_S
        for child in attempt.children.values():
            child.returncode = child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._log_new_checkpoint()
        self._current = None

    def _log_new_checkpoint(self) -> None:
        steps = committed_steps(self.paths.checkpoints)
        if steps and steps[-1] != self._logged_checkpoint:
            self._logged_checkpoint = steps[-1]
            number = self._attempts[-1].number if self._attempts else 0
            self._event("checkpoint", attempt=number, step=steps[-1])

    def _event(self, kind: str, **fields: Any) -> None:
        if self._sink is None:
            self._sink = JsonlSink(self.paths.metrics)
        self._sink.event(kind, **fields)

    # ---- summary ----

    def _summary(self, final_step: int) -> dict[str, Any]:
        steps: set[tuple[int, int]] = set()
        val_loss = None
        for rank in range(self.world_size):
            path = self.paths.rank_metrics(rank)
            lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
            steps |= computed_steps(lines)  # every rank logs every step; a rank that died early logs fewer
            if rank == 0:
                val_loss = _last_value(lines, "dp/val_loss")
        account = job_account(steps, {a.number: a.from_step for a in self._attempts}, final_step=final_step)
        assert self._started_at is not None
        return {"attempts": len(self._attempts), "failures": self.failures, "final_step": final_step,
                "steps_computed": account.computed, "steps_kept": account.kept,
                "steps_rolled_back": account.rolled_back, "grad_bytes": self._grad_bytes,
                "allreduce_bytes": int(account.computed * self.world_size
                                       * ring_allreduce_bytes(self.world_size, self._grad_bytes)),
                "final_val_loss": val_loss, "start_s": [a.start_s for a in self._attempts], "gave_up": self.failure,
                "wall_time_s": time.monotonic() - self._started_at}


def _last_value(lines: list[str], name: str) -> float | None:
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and name in record:
            return float(record[name])
    return None
