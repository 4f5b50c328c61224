"""What a learner's failed exit means, for both supervisors (`supervisor.Supervisor` restarts locally, the Ray actors
of `ray_actor.RoleActor` through Ray): the two rules that keep a restart from being the wrong answer.

- **Done, then crashed**: the learner's `status.json`, written by the process that just exited, says done. A native
  library aborting at interpreter exit (gloo or NCCL teardown can) loses no work, and a restart would only finish
  again: the learner is done.
- **A crash loop** (`CrashLoop`), two ways, each given up with the last line of the learner's log as the reason:
  - *before the session*: `max_exits_before_session` starts in a row ended with an error before the process wrote
    its status file (a script that fails at import, a model that cannot be built). A death by a signal is a fault,
    not the script's: it does not count, and like a start that reached its session it starts the count again.
  - *without progress*: `max_exits_without_progress` starts in a row reached their session and ended with an error
    without training past the furthest inner step any start of the learner had reached (an error at the same step
    at every restart: a learning-rate scheduler stepped past its total, a batch that always fails). Each restart
    resumes from the checkpoint and fails again where the last one did. A start that trains further starts the
    count again; a death by a signal is not counted either way (it still tells how far the learner got).

And one rule for an exit 0 (`stopped_from_outside`): a learner whose session stopped before the run's budget because
it was asked to (its final status says `stop_requested`; its script's loop did not end there) was stopped by a SIGTERM
that the launcher did not send (a preemption, a `kill`): it is restarted, and resumes from the checkpoint it saved at
the stop.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.rank_group import FAILED_RANK_LINE
from ddiloco.transport.grpc_codec import shortened


def describe_exit(code: int) -> str:
    """`exit code 1`, `signal SIGKILL`."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


MAX_REASON_CHARS = 300
"""The most of a log line an exit message quotes."""


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: |$)")
"""A Python exception's own line at the end of a traceback: `ValueError: ...`, `torch.OutOfMemoryError: ...`."""
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")
"""What torch puts before every line of a rank's uncaught exception once its process group is set up: `[rank1]: `."""
RECENT_LINES = 5
"""How many of a process's last log lines may hold the exception that ended it (the end of its traceback). Above
them an exception line is one the script logged and went on from, unless a rank group says which rank failed."""
EXIT_LOG_LINES = 2000
"""How many lines of an exit's log the supervisor reads: enough for the first failing rank's exception above the
other ranks' tracebacks (`reason_line`)."""


def reason_line(tail: list[str]) -> str:
    """The line of a process's last log lines that says why it ended. For a learner of several ranks (its rank group
    logged which rank failed first) the exception of that rank: the others fail after it, in a collective with it;
    failing that, for a rank killed by a signal, the rank group's line. Otherwise the last Python exception line among
    the last `RECENT_LINES`, else the last line. torch's `[rankN]: ` prefix is left out."""
    for index in range(len(tail) - 1, -1, -1):
        if (failed := FAILED_RANK_LINE.search(tail[index])) is not None:
            return _failed_rank_reason(tail[:index] + tail[index + 1:], *(int(group) for group in failed.groups()))
    return _last_exception_line(tail[-RECENT_LINES:]) or tail[-1].strip()


def refusal_reason(tail: list[str]) -> str:
    """Why the syncer refused a learner that exited with `EXIT_REFUSED`, from its last log lines (`reason_line`),
    without the session's own `[learner N] refused by the syncer: ` (the launcher says that)."""
    line = reason_line(tail)
    return line[line.index(REFUSED_BY) + len(REFUSED_BY):] if REFUSED_BY in line else line


REFUSED_BY = "refused by the syncer: "


def _failed_rank_reason(lines: list[str], rank: int, pid: int, status: int) -> str:
    """Why rank `rank` (the first to fail, with `status`: 128 + N for signal N) ended its learner, from the log's
    other lines."""
    own = [line for line in lines if _rank_of(line) == rank]
    if (line := _last_exception_line(own)) is not None:
        return line
    said = f"rank {rank} (pid {pid}) exited with status {status}"
    if status > 128:
        return f"{said} ({describe_exit(128 - status)})"
    # Not an uncaught exception of that rank (a refusal the session logged, an error before torch's prefix is set
    # up): what no other rank's traceback says.
    unranked = [line for line in lines if _rank_of(line) is None]
    return _last_exception_line(unranked[-RECENT_LINES:]) or (unranked[-1].strip() if unranked else said)


def _rank_of(line: str) -> int | None:
    prefix = _RANK_PREFIX.match(line.strip())
    return int(prefix[1]) if prefix is not None else None


def _last_exception_line(lines: list[str]) -> str | None:
    for line in reversed(lines):
        text = _RANK_PREFIX.sub("", line.strip(), count=1)
        if _EXCEPTION_LINE.match(text):
            return text
    return None


def describe_exit_with(code: int, tail: list[str]) -> str:
    """`exit code 1: RuntimeError: my data loader broke`: an error exit with the line of its last log lines that says
    why (`reason_line`: a Python exception's own line), so that the console says why without opening the log; a
    signal as `describe_exit` (the log's last line then is whatever ran before it, not the reason)."""
    if code <= 0 or not tail:
        return describe_exit(code)
    return f"{describe_exit(code)}: {shortened(reason_line(tail), MAX_REASON_CHARS)}"


def status_since(status_path: Path, started_wall: float) -> dict[str, Any]:
    """The learner's status file if the process started at `started_wall` (wall-clock seconds) wrote it; {} if it
    wrote none (a stale one from an earlier start, or an earlier run before `--resume`, does not count)."""
    status = read_json_object(status_path) or {}
    written = status.get("time")
    return status if isinstance(written, int | float) and written >= started_wall else {}


def started_wall(started_monotonic: float) -> float:
    """The wall-clock time of a monotonic start time (the status file's `time` is wall-clock)."""
    return time.time() - (time.monotonic() - started_monotonic)


def _before_budget(status: dict[str, Any]) -> tuple[int, int] | None:
    """(inner step, budget) of a status that says `stopped` before the run's budget, else None."""
    step, budget = status.get("inner_step"), status.get("inner_steps")
    if status.get("state") == "stopped" and isinstance(step, int) and isinstance(budget, int) and step < budget:
        return step, budget
    return None


def stopped_from_outside(status: dict[str, Any], *, last_stop_step: int | None = None) -> bool:
    """Whether a learner that exited with status 0 was stopped by a SIGTERM that its launcher did not send (asked while
    the launcher is not stopping it): its status (`status_since`) says `stopped` before the run's budget and
    `stop_requested` (its loop did not end by itself), and it did not stop at `last_stop_step`, the inner step where
    its last start stopped this way. Such a learner is restarted: it resumes from the checkpoint it saved at the stop.
    A restart that stops where the last one did, without a step in between (a script that sends itself a SIGTERM
    there), is done, not restarted again."""
    where = _before_budget(status)
    return where is not None and where[0] != last_stop_step and status.get("stop_requested") is True


def describe_outside_stop(status: dict[str, Any]) -> str:
    """The exit message of a learner `stopped_from_outside`."""
    where = _before_budget(status)
    at = f" at inner step {where[0]} of {where[1]}" if where is not None else ""
    return f"stopped{at} by a signal ddiloco run did not send: restarted from its checkpoint"


NO_SESSION = ("done, but without a ddiloco session: the script exited with status 0 before it called "
              "ddiloco.session, so it trained nothing here (does it call its main()? docs/your_model.md); not "
              "restarted")
"""How a learner that exited with status 0 and never wrote its status file ends: a script whose `main()` is defined
and never called ended the run `completed: 0 rounds committed` with every learner `exited (done)`."""


def describe_done(status: dict[str, Any]) -> str:
    """How a learner that exited with status 0 and is done ended, from its status (`status_since`): `done`, or, when
    its own loop ended before the run's budget (its session says `stopped`), at which step of how many, or, without a
    status (its process never opened a session), `NO_SESSION`. Not restarted either way: the script ended itself, and
    a restart would run the same script to the same end."""
    if not status:
        return NO_SESSION
    where = _before_budget(status)
    if where is not None:
        return f"done: its loop ended at inner step {where[0]} of {where[1]}, before the budget; not restarted"
    return "done"


def finished_session(status: dict[str, Any]) -> bool:
    """The status (from `status_since`) of a process that finished its session before it exited."""
    return status.get("state") == "done"


@dataclass
class CrashLoop:
    """What one learner's failed exits have shown so far, across its processes (module docstring): the counts of the
    two crash-loop rules and the furthest inner step a start reached. The local supervisor keeps one per learner; a
    Ray role carries it from one actor incarnation to the next in its state file (`as_json`, `from_json`)."""

    before_session: int = 0
    """Starts in a row that exited with an error before their session began."""
    without_progress: int = 0
    """Starts in a row that exited with an error in their session without training past `furthest_step`."""
    furthest_step: int | None = None
    """The furthest inner step a start of this learner reported at its exit (None: none reported one yet)."""

    def count(self, code: int, status: dict[str, Any]) -> None:
        """Count an exit with `code` (not done, not refused) whose process wrote `status` (`status_since`; {}: none)."""
        self.before_session = self.before_session + 1 if code > 0 and not status else 0
        step = status.get("inner_step")
        if not isinstance(step, int):
            return
        if self.furthest_step is None or step > self.furthest_step:
            self.furthest_step, self.without_progress = step, 0
        elif code > 0:
            self.without_progress += 1

    def give_up_reason(self, code: int, tail: list[str], log_path: Path, *, max_before_session: int,
                       max_without_progress: int, session: str = "its session started") -> str | None:
        """Why the learner is given up after the exit just counted, or None: restart it. `session`: what a start
        that got somewhere reached (the evaluator's: "its first evaluation")."""
        if self.before_session >= max_before_session:
            why = f"{self.before_session} starts in a row ended before {session}"
        elif self.without_progress >= max_without_progress:
            why = (f"{self.without_progress} restarts in a row failed without training past inner step "
                   f"{self.furthest_step}")
        else:
            return None
        last = reason_line(tail) if tail else describe_exit(code)
        return f"{last} ({why}, the last with {describe_exit(code)}; its log: {log_path})"

    def as_json(self) -> dict[str, Any]:
        return {"before_session": self.before_session, "without_progress": self.without_progress,
                "furthest_step": self.furthest_step}

    @classmethod
    def from_json(cls, data: Any) -> CrashLoop:
        """From `as_json`'s output; anything else (an older state file) starts afresh."""
        if not isinstance(data, dict):
            return cls()
        furthest = data.get("furthest_step")
        counts = [data.get(name) for name in ("before_session", "without_progress")]
        if not all(isinstance(n, int) and n >= 0 for n in counts) or not isinstance(furthest, int | None):
            return cls()
        return cls(counts[0], counts[1], furthest)


DONE_AFTER_SESSION = "after its session had finished: done, not restarted"
"""The end of the event message for a learner that crashed after it was done."""
STOPPED_AFTER_SESSION = "after its session had finished: done"
"""The end of the event message for a learner that the launcher's stop (a Ctrl-C) found done: its session had finished
and it was on its way out (its exit status then is the stop's, a SIGTERM's)."""
