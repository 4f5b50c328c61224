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
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import read_json_object
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


def reason_line(tail: list[str]) -> str:
    """The line of a process's last log lines that says why it ended: the last Python exception line among them (a
    learner of several ranks logs, after a rank's traceback, that the rank exited), else the last line."""
    for line in reversed(tail):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()
    return tail[-1].strip()


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


def describe_done(status: dict[str, Any]) -> str:
    """How a learner that exited with status 0 ended, from its status (`status_since`): `done`, or, when its own
    loop ended before the run's budget (its session says `stopped`), at which step of how many. Not restarted
    either way: the script ended its loop itself, and a restart would run the same script to the same end."""
    step, budget = status.get("inner_step"), status.get("inner_steps")
    if status.get("state") == "stopped" and isinstance(step, int) and isinstance(budget, int) and step < budget:
        return f"done: its loop ended at inner step {step} of {budget}, before the budget; not restarted"
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
                       max_without_progress: int) -> str | None:
        """Why the learner is given up after the exit just counted, or None: restart it."""
        if self.before_session >= max_before_session:
            why = f"{self.before_session} starts in a row ended before its session started"
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
