"""The supervised roles, as both supervisors see them (`ddiloco.runtime.supervisor` runs them as local processes,
`ddiloco.runtime.ray_supervisor` as Ray actors): each role's `Slot` and its `ChildState`, the `Event`s reported about
it, the role names and the exit codes that decide whether it is restarted, and `SupervisorConfig`, the timing of
its supervision. What a supervisor does with them is its own module's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ddiloco.backoff import Backoff
from ddiloco.checks import require_int
from ddiloco.runtime.child_process import ChildProcess
from ddiloco.runtime.learner_exits import CrashLoop
from ddiloco.runtime.standby import DEFAULT_REFILL_DELAY_S

SYNCER = "syncer"
EVALUATOR = "evaluator"


class ChildState(enum.StrEnum):
    STARTING = "starting"
    """Started; the syncer has not yet published its address."""
    RUNNING = "running"
    BACKOFF = "backoff"
    """Exited; waiting out its backoff before the restart."""
    PENDING = "pending"
    """A learner not started yet because the syncer has no address yet."""
    DONE = "done"
    REFUSED = "refused"
    FAILED = "failed"
    """Will not be restarted (usage error, or too many restarts)."""
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        return self in (ChildState.DONE, ChildState.REFUSED, ChildState.FAILED, ChildState.STOPPED)


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    """Timing of the supervision loop; every field in seconds unless it says otherwise."""

    poll_interval_s: float = 0.1
    """The one loop interval: how quickly an exit is noticed and a signal obeyed."""
    backoff_initial_s: float = 0.5
    """First restart delay of a child."""
    backoff_max_s: float = 8.0
    """The delay doubles per restart up to this cap."""
    stable_after_s: float = 30.0
    """A child that ran at least this long before it died restarts with the initial delay again."""
    max_restarts: int = 100
    """Restarts in a row of one child that each failed within `stable_after_s` of their start after which it is
    given up as failed: a crash loop, not a fault (`Slot.count_exit`). A run of at least `stable_after_s` starts the
    count again, and a death by a signal (`kill -9`, the OOM killer, a preemption) is a fault and does not count, so a
    long run whose children are killed now and then is never given up. Bounds the syncer and the evaluator too, which
    have no `CrashLoop`; the Ray supervisor hands it to Ray, which counts every restart of an actor's life."""
    max_exits_before_session: int = 3
    """Starts in a row of one learner that exited with an error before its training session began (before it
    wrote its status file: a script that fails at import, a model that cannot be built) after which it is given
    up as failed, with the last line of its log as the reason: the same start would fail again. A death by a
    signal does not count (a fault, not the script's)."""
    max_exits_without_progress: int = 3
    """Restarts in a row of one learner that reached their session and exited with an error without training past
    the furthest inner step it had reached (the same error at the same step each time: a scheduler stepped past its
    total, a batch that always fails) after which it is given up as failed, with the last line of its log as the
    reason (`learner_exits.CrashLoop`). A start that trains further starts the count again."""
    syncer_start_timeout_s: float = 120.0
    """Longest a started syncer may take to write syncer.json before it is killed and restarted."""
    learner_stop_timeout_s: float = 30.0
    """SIGTERM -> SIGKILL delay for learners (they save a checkpoint and say Leave)."""
    syncer_stop_timeout_s: float = 120.0
    """SIGTERM -> SIGKILL delay for the syncer (it makes its last round durable and evaluates)."""
    standby_learners: int = 0
    """Warm learner processes kept waiting for a role (`ddiloco.runtime.standby`); 0: every start is cold."""
    standby_refill_delay_s: float = DEFAULT_REFILL_DELAY_S
    """How long after a standby is used its replacement starts (its imports then do not compete with
    the restarted learner's own start)."""
    standby_syncer: bool = False
    """Keep a standby syncer (`ddiloco.runtime.syncer_standby`) following the syncer's durable state; when the
    syncer dies it takes over on the same address, and a new standby starts `standby_refill_delay_s` later."""

    def __post_init__(self) -> None:
        require_int("standby_learners", self.standby_learners, minimum=0)
        if not self.standby_refill_delay_s >= 0:
            raise ValueError(f"standby_refill_delay_s={self.standby_refill_delay_s!r} is invalid: "
                             "expected seconds >= 0")
        for name in ("poll_interval_s", "backoff_initial_s", "backoff_max_s", "syncer_start_timeout_s",
                     "learner_stop_timeout_s", "syncer_stop_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a number > 0 (seconds)")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s={self.backoff_max_s} must be >= backoff_initial_s="
                             f"{self.backoff_initial_s}")
        if self.stable_after_s < 0:
            raise ValueError(f"stable_after_s={self.stable_after_s} is invalid: expected >= 0 (seconds)")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} is invalid: expected >= 0")
        require_int("max_exits_before_session", self.max_exits_before_session, minimum=1)
        require_int("max_exits_without_progress", self.max_exits_without_progress, minimum=1)


@dataclass(frozen=True)
class Event:
    """Something the supervisor did or saw. `name` is "syncer" or "learner-N"."""

    kind: str
    """started, address, exited, restart_scheduled, done, refused, failed, stopping, waiting (children still running
    a while after their SIGTERM), stopped."""
    name: str
    learner_id: int | None
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Slot:
    """One supervised role: the syncer or learner N, across all its processes."""

    name: str
    learner_id: int | None
    backoff: Backoff
    state: ChildState = ChildState.PENDING
    process: ChildProcess | None = None
    restarts: int = 0
    """Every restart of this role so far (the table and the summary show it)."""
    failed_in_a_row: int = 0
    """Exits in a row that failed within `SupervisorConfig.stable_after_s` of their start (`count_exit`): what
    `SupervisorConfig.max_restarts` bounds."""
    restart_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)
    reason: str = ""
    """Why it ended (refused, failed), from its log; for an evaluator stopped while it waited to restart, how its last
    start ended."""
    last_exit: str = ""
    """How its latest process ended when that was a failure it is restarted after (`exited with exit code 1:
    ValueError: ...`); empty until then."""
    pids: list[int] = field(default_factory=list)
    held_until: float | None = None
    """Monotonic time before which it is not restarted (`Supervisor.hold`)."""
    starting_since: float = 0.0
    """Monotonic time when the current process was started (the syncer's: or took over): its run's length, and the
    syncer's start timeout, run from here."""
    crash_loop: CrashLoop = field(default_factory=CrashLoop)
    """A learner's failed exits so far, as the crash-loop rules count them."""
    outside_stop_step: int | None = None
    """The inner step where a process of this learner last stopped on a SIGTERM the launcher did not send
    (`learner_exits.stopped_from_outside`)."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None

    def started(self, process: ChildProcess, *, state: ChildState = ChildState.RUNNING,
                since: float | None = None) -> None:
        """A new process of this role: its pid kept for the run's record, no restart due, `state` (STARTING for the
        syncer until it serves) from `since` (default: the process's own start time)."""
        self.process = process
        self.pids.append(process.pid)
        self.state = state
        self.restart_at = None
        self.starting_since = process.started_at if since is None else since

    def count_exit(self, code: int, ran_for_s: float, *, stable_after_s: float) -> None:
        """Count an exit with `code` of a process that ran `ran_for_s` seconds into `failed_in_a_row`: a run of at
        least `stable_after_s` starts the count again; a shorter one that ended by a signal (code < 0, as
        `learner_exits` tells a signal) is a fault and leaves the count as it is; any other exit counts one."""
        if ran_for_s >= stable_after_s:
            self.failed_in_a_row = 0
        elif code >= 0:
            self.failed_in_a_row += 1

    def restarts_exhausted(self, max_restarts: int, stable_after_s: float) -> str | None:
        """Why this role is given up after its last exit, counted (`count_exit`), or None: more starts in a row
        failed within `stable_after_s` of their start than `max_restarts` (a first failure, then `max_restarts`
        restarts that failed too)."""
        if self.failed_in_a_row <= max_restarts:
            return None
        return (f"after {self.failed_in_a_row} starts in a row that each failed within {stable_after_s:g} s of "
                "their start")
