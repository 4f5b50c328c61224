"""What a learner's failed exit means, for both supervisors (`supervisor.Supervisor` restarts locally, the Ray actors
of `ray_actor.RoleActor` through Ray): the two rules that keep a restart from being the wrong answer.

- **Done, then crashed**: the learner's `status.json`, written by the process that just exited, says done. A native
  library aborting at interpreter exit (gloo or NCCL teardown can) loses no work, and a restart would only finish
  again: the learner is done.
- **A crash loop before the session**: `max_exits_before_session` starts in a row ended with an error before the
  process wrote its status file (a script that fails at import, a model that cannot be built). The same start would
  fail again: the learner is given up, with the last line of its log as the reason. A death by a signal is a fault,
  not the script's: it does not count, and like a start that reached its session it starts the count again.
"""

from __future__ import annotations

import signal
import time
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


def describe_exit_with(code: int, tail: list[str]) -> str:
    """`exit code 1: RuntimeError: my data loader broke`: an error exit with the last line its process logged (a
    Python exception's own line), so that the console says why without opening the log; a signal as
    `describe_exit` (the log's last line then is whatever ran before it, not the reason)."""
    if code <= 0 or not tail:
        return describe_exit(code)
    return f"{describe_exit(code)}: {shortened(tail[-1].strip(), MAX_REASON_CHARS)}"


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


def exits_before_session(code: int, status: dict[str, Any], in_a_row: int) -> int:
    """The count of starts in a row that ended with an error before the session began, after this exit."""
    return in_a_row + 1 if code > 0 and not status else 0


def crash_loop_reason(code: int, tail: list[str], in_a_row: int, log_path: Path) -> str:
    """Why a learner is given up after `in_a_row` starts that ended before their session."""
    return (f"{tail[-1] if tail else describe_exit(code)} ({in_a_row} starts in a row ended before its session "
            f"started, the last with {describe_exit(code)}; its log: {log_path})")


DONE_AFTER_SESSION = "after its session had finished: done, not restarted"
"""The end of the event message for a learner that crashed after it was done."""
