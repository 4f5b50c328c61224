"""The learner's rules between messages: one sans-I/O layer above the `Learner` core, for every driver.

The core (`ddiloco.learner`) knows what a message does to the model. What a learner does between
messages is decided here, once, and the real runtime (`ddiloco.session`), the in-process hub and the
virtual-time harness (`ddiloco.sim.decoupled`) all drive this class instead of writing the rules
themselves (like h11 keeps every state transition in one module):

- **When to train** (`next(now)`): not before the first Welcome; while the tau waiting rule blocks,
  wait, but for at most `LearnerConfig.max_wait_s`, after which `Learner.stop_waiting()` is called and
  the learner trains on.
- **Where to resume on a (re)join** (`receive(Welcome)`): at the first Welcome of an incarnation, a
  learner takes the global schedule position that Welcome implies (`Learner.take_schedule_position`),
  so it publishes in phase with the others, when it has no position of its own (a fresh incarnation:
  nothing restored) or when the run is synchronous (K = M: every round commits once, and a learner out
  of phase would make the waiting rule deadlock the round that needs its update). A learner resumed
  from its checkpoint in a run with K < M keeps the checkpoint's position: rounds close without it.
  At a later Welcome (the same process joined again: the syncer timed it out during a pause or a
  partition) a learner of a synchronous run takes the position only when it is behind, rounds it had not
  published committed without it; one ahead (its update lost with a syncer restart) keeps its own and
  publishes that update again. One behind that kept its position would make every round wait the
  learners' `max_wait_s` for an update of another phase (about 60 s a round).
- **A syncer that went back** (a Welcome to this process joining again holds an older version of a
  fragment than the learner received) is a refusal: its directory was replaced, or the address serves a
  copy of the run (`_went_back`).
- **Malformed messages** are faults, not crashes: logged and ignored.
- **The end** (`finish()`): every fragment's unpublished work is published once more
  (`Learner.flush`), so the final global model includes the learner's last inner steps.
- **The work ledger's events** (`WorkEvents`): what was published, what became of each update, what
  each Welcome or received fragment threw away, the schedule position, the end.

Time is passed in; nothing here sleeps, reads a clock, or touches a socket.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ddiloco.config import LearnerConfig
from ddiloco.learner import Learner
from ddiloco.messages import FragmentDelta, FragmentState, LearnerMessage, Refused, SyncerMessage, Update, Welcome
from ddiloco.round_schedule import next_uncommitted_round

logger = logging.getLogger(__name__)


class WorkEvents(Protocol):
    """Where the rules report a learner's work (`ddiloco.work_ledger.WorkLedger` writes it down)."""

    def publish(self, update: Update) -> None: ...
    def fate(self, update: Update, fate: str, reason: str) -> None: ...
    def welcome(self, welcome: Welcome, *, inner_step: int, replaced: Sequence[int]) -> None: ...
    def received(self, state: FragmentState | FragmentDelta, *, inner_step: int) -> None: ...
    def position(self, *, inner_step: int, next_round: int) -> None: ...
    def end(self, state: str, *, inner_step: int) -> None: ...


class NoWorkEvents:
    """Nobody keeps a ledger (the in-process hub, the harness, which accounts for work itself)."""

    def publish(self, update: Update) -> None:
        pass

    def fate(self, update: Update, fate: str, reason: str) -> None:
        pass

    def welcome(self, welcome: Welcome, *, inner_step: int, replaced: Sequence[int]) -> None:
        pass

    def received(self, state: FragmentState | FragmentDelta, *, inner_step: int) -> None:
        pass

    def position(self, *, inner_step: int, next_round: int) -> None:
        pass

    def end(self, state: str, *, inner_step: int) -> None:
        pass


class Action(enum.Enum):
    STEP = "step"
    """Train the next inner step."""
    WAIT = "wait"
    """Wait for a message from the syncer until `Next.until` (then ask again)."""
    JOIN = "join"
    """Not joined yet (or joining again): wait for the Welcome, without a bound."""
    REFUSED = "refused"
    """The syncer refused this learner: stop."""


@dataclass(frozen=True)
class Next:
    action: Action
    until: float | None = None
    """For WAIT: the time at which the wait bound ends."""


class LearnerRules:
    """A learner's rules between messages, around its `Learner` core. See the module docstring."""

    def __init__(self, learner: Learner, config: LearnerConfig, *, synchronous: bool,
                 events: WorkEvents | None = None) -> None:
        """`synchronous`: the run closes a round only with every live learner (K >= M > 1)."""
        self.learner = learner
        self.config = config
        self.synchronous = synchronous
        learner.schedule.follows_rounds = not synchronous
        self.resumed = False
        """Set by the driver when the learner's progress came from its checkpoint (it keeps that position
        unless the run is synchronous)."""
        self.events: WorkEvents = events or NoWorkEvents()
        self.refusal: str | None = None
        self.refused_for_another_process = False
        """The refusal said another process holds this learner id: its checkpoint is not this process's to write."""
        self.welcomes = 0
        self._wait_started: float | None = None
        self.last_wait_s: float | None = None
        """Length of the last wait that ended in a step (a driver logs it), None if there was none yet."""

    # ---- messages --------------------------------------------------------------------------------

    def receive(self, message: SyncerMessage, now: float) -> list[LearnerMessage]:
        """Apply one message from the syncer; returns the learner's replies (a re-published update)."""
        learner = self.learner
        if isinstance(message, Refused):
            self.refusal = message.reason
            self.refused_for_another_process = message.another_process
        if isinstance(message, Welcome):
            if self.welcomes > 0 and (went_back := self._went_back(message)) is not None:
                self.refusal = went_back
                return []
            run_round = next_uncommitted_round(message)
            if self.welcomes == 0:
                move = (self.synchronous or not self.resumed) and run_round != learner.schedule.next_round
            else:  # a re-join of this process (the syncer timed it out: a pause, a partition)
                move = self.synchronous and run_round > learner.schedule.next_round
                if move:
                    logger.warning("[learner %d | inner %d] re-joined behind the run: rounds %d to %d were committed "
                                   "without it, so it takes the run's position (round %d next) to publish in phase "
                                   "with the others", learner.learner_id, learner.inner_step,
                                   learner.schedule.next_round, run_round - 1, run_round)
            if move:
                learner.take_schedule_position(message)
                self.events.position(inner_step=learner.inner_step, next_round=learner.schedule.next_round)
            self.welcomes += 1
        applied = learner.stats.fragments_applied
        before = list(learner.versions)
        try:
            replies = learner.receive(message)
        except ValueError as exc:  # a malformed message: a fault to record, not a crash
            logger.error("[learner %d | inner %d] ignored a message from the syncer: %s",
                         learner.learner_id, learner.inner_step, exc)
            return []
        updates = [reply for reply in replies if isinstance(reply, Update)]
        if isinstance(message, Welcome):
            # Work trained on a version older than the Welcome's (`Learner._send_before_welcome`) was published on
            # the version held before it: the ledger says so by its order; the rest is published again after it.
            welcomed = {state.fragment: state.version for state in message.fragments}
            for update in updates:
                if update.base_version < welcomed.get(update.fragment, update.base_version):
                    self.events.publish(update)
            updates = [u for u in updates if u.base_version >= welcomed.get(u.fragment, u.base_version)]
            replaced = [p for p, v in enumerate(before) if v < 0 or v != learner.versions[p]]
            self.events.welcome(message, inner_step=learner.inner_step, replaced=replaced)
        elif isinstance(message, FragmentState | FragmentDelta) and learner.stats.fragments_applied > applied:
            self.events.received(message, inner_step=learner.inner_step)
        for update in updates:
            self.events.publish(update)  # published again after a re-join
        return replies

    def _went_back(self, welcome: Welcome) -> str | None:
        """Why a Welcome to this process joining again comes from a syncer whose state went back, or None: it holds an
        older version of a fragment than this learner received from it. A syncer never goes back (a round is durable
        before it is sent), so its run directory was replaced (a backup restored) or the address serves a copy of the
        run: the learner had trained on in silence from the older state, the rounds since lost (the same learner
        restarted was refused, by its checkpoint: `LearnerCheckpoint.foreign`)."""
        versions = self.learner.versions
        for state in welcome.fragments:
            if 0 <= state.version < versions[state.fragment]:
                return (f"the syncer now holds version {state.version} of fragment {state.fragment}, and this learner "
                        f"had received version {versions[state.fragment]} of it: a syncer never goes back (a round is "
                        "durable before it is sent), so its run directory was replaced (a backup restored) or its "
                        "address serves a copy of the run. The learner stops without training on it and keeps its "
                        "checkpoint; restore the syncer's newer directory, or give the learner a new --run-dir to "
                        "join the older state afresh")
        return None

    def fate(self, update: Update, fate: str, reason: str) -> None:
        """What became of a published update: accepted, rejected (the syncer's reason) or dropped."""
        self.events.fate(update, fate, reason)

    # ---- stepping --------------------------------------------------------------------------------

    def next(self, now: float) -> Next:
        """What the driver does now: train, wait (bounded), wait for the Welcome, or stop."""
        learner = self.learner
        if self.refusal is not None:
            return Next(Action.REFUSED)
        if not learner.joined:
            return Next(Action.JOIN)
        if not learner.can_step:
            if self._wait_started is None:
                self._wait_started = now
            until = self._wait_started + self.config.max_wait_s
            if now < until:
                return Next(Action.WAIT, until)
            learner.stop_waiting()
        if self._wait_started is not None:
            self.last_wait_s = now - self._wait_started
            self._wait_started = None
        return Next(Action.STEP)

    @property
    def waiting_since(self) -> float | None:
        return self._wait_started

    def after_inner_step(self, tokens: int, *, seconds: float | None = None) -> list[Update]:
        """One inner step of `tokens` tokens is done, in `seconds` of compute (if timed): the updates now due, recorded
        as published."""
        updates = self.learner.after_inner_step(tokens, seconds=seconds)
        for update in updates:
            self.events.publish(update)  # before a sender thread can report its fate
        return updates

    def finish(self) -> list[Update]:
        """Training is over: the final updates that publish every fragment's unpublished work."""
        updates = self.learner.flush()
        for update in updates:
            self.events.publish(update)
        if updates:
            logger.info("[learner %d | inner %d] published the last work of fragments %s",
                        self.learner.learner_id, self.learner.inner_step, [u.fragment for u in updates])
        return updates

    def end(self, state: str) -> None:
        self.events.end(state, inner_step=self.learner.inner_step)
