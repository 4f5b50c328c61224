"""The loop both supervisors run: start the run, poll it until it is over or a stop is asked for, shut it down.

`ddiloco.runtime.supervisor.Supervisor` supervises local processes, `ddiloco.runtime.ray_supervisor.RaySupervisor`
Ray actors; what a poll or a shutdown does is theirs, when they happen is this module's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class _State(Protocol):
    @property
    def final(self) -> bool: ...


class _Slot(Protocol):
    """A supervised role, as far as the loop looks at it (`ddiloco.runtime.supervised_roles.Slot`)."""

    state: _State


class _Config(Protocol):
    poll_interval_s: float


class SupervisionLoop:
    """What both supervisors share (processes here, Ray actors in `ddiloco.runtime.ray_supervisor`): the loop that
    starts the run, polls it until every learner is done, the run failed or a stop was asked for, and shuts it down,
    also after a start that failed halfway (whatever it had started is stopped). A subclass sets `config`, `syncer`,
    `learners`, `evaluator` and `failure`, and defines `start`, `poll` and `shutdown` (idempotent)."""

    config: _Config
    syncer: _Slot
    learners: list[_Slot]
    evaluator: _Slot | None
    failure: str | None
    _stop_reason: str | None = None
    _kill_now: bool = False

    def start(self) -> None:
        raise NotImplementedError

    def poll(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def slots(self) -> list[_Slot]:
        return [self.syncer, *self.learners, *([self.evaluator] if self.evaluator is not None else [])]

    @property
    def finished(self) -> bool:
        """Every learner is done or will never run again, or the run failed."""
        return self.failure is not None or all(slot.state.final for slot in self.learners)

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def request_stop(self, reason: str) -> None:
        """Ask the loop to shut down (a signal handler calls this); a second request kills at once."""
        if self._stop_reason is not None:
            self._kill_now = True
        else:
            self._stop_reason = reason

    def run(self, *, on_tick: Callable[[], None] | None = None) -> None:
        """Start, supervise until finished or asked to stop, then shut everything down (also after a failed
        start)."""
        try:
            self.start()
            while not self.finished and self._stop_reason is None:
                self.poll()
                if on_tick is not None:
                    on_tick()
                if not self.finished:
                    time.sleep(self.config.poll_interval_s)
        finally:
            self.shutdown()
            if on_tick is not None:
                on_tick()
