"""In-process transport: learners and the syncer in one Python process, messages delivered at once.

The smallest driver of the sans-I/O cores, for the library quickstart, notebooks and tests. There is
no network, no thread and no serialisation: a learner's messages reach the syncer when the learner
calls the hub, and the syncer's answers reach the learners before the call returns, so a fragment
is always applied between two inner steps.
"""

from __future__ import annotations

from collections.abc import Callable

from ddiloco.clock import Clock, MonotonicClock
from ddiloco.learner import Learner
from ddiloco.messages import Commit, LearnerMessage, Leave, RoundRecord, Send, SyncerAction
from ddiloco.syncer import Syncer


class JoinRefusedError(RuntimeError):
    """The syncer refused a learner (different model, config or schema); the message says why."""


class InProcessHub:
    """Routes messages between a `Syncer` and the `Learner`s attached to it, in one process."""

    def __init__(self, syncer: Syncer, *, clock: Clock | None = None,
                 on_commit: Callable[[RoundRecord], None] | None = None) -> None:
        self.syncer = syncer
        self.clock = clock or MonotonicClock()
        self.learners: dict[int, Learner] = {}
        self.round_log: list[RoundRecord] = []
        self._on_commit = on_commit

    def join(self, learner: Learner) -> None:
        """Attach a learner and load the global parameters into it. Raises JoinRefusedError."""
        self.learners[learner.learner_id] = learner
        self._deliver([learner.join_message()])
        if not learner.joined:
            del self.learners[learner.learner_id]
            raise JoinRefusedError(learner.refused_reason or "no answer from the syncer")

    def after_inner_step(self, learner: Learner, tokens: int) -> None:
        """Call after each inner step of `learner` (after `optimizer.step()`)."""
        self._deliver(learner.after_inner_step(tokens))
        self.advance()

    def advance(self) -> None:
        """Let the syncer close rounds whose grace window has ended."""
        self._run(self.syncer.advance(self.clock.now()))

    def leave(self, learner: Learner) -> None:
        self.learners.pop(learner.learner_id, None)
        self._deliver([Leave(learner.learner_id)])

    def _deliver(self, messages: list[LearnerMessage]) -> None:
        for message in messages:
            self._run(self.syncer.receive(message, self.clock.now()))

    def _run(self, actions: list[SyncerAction]) -> None:
        for action in actions:
            if isinstance(action, Commit):
                self.round_log.append(action.record)
                if self._on_commit is not None:
                    self._on_commit(action.record)
            elif isinstance(action, Send):
                learner = self.learners.get(action.learner_id)
                if learner is not None:
                    self._deliver(learner.receive(action.message))
