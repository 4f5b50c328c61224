"""The syncer's side of the Decoupled DiLoCo harness (`ddiloco.sim.decoupled`): the real `Syncer` on the virtual clock.

Owns what happens once a message from a live learner incarnation has reached the syncer: the core's
`receive`, the fate of each update (accepted or rejected, booked in `FragmentWork`), the syncer's timer
(`advance` runs at its `next_deadline()`, so silent learners time out and grace windows end on time), and
each commit: appended to the round log (durable) before the sends that follow it, its merged tokens and
the global model's advance booked, the observers told. What crosses the downlink, and whether the learner
is still there to receive it, is the driver's business: the node hands every `Send` to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ddiloco.goodput import Advance
from ddiloco.messages import Commit, FragmentDelta, FragmentState, Rejected, RoundRecord, Send, Update
from ddiloco.sim.accounting import FragmentWork
from ddiloco.sim.engine import EventLoop
from ddiloco.syncer import Syncer


class RoundObserver(Protocol):
    """Optional hooks for experiments that look inside rounds (e.g. update norms)."""

    def on_accepted(self, update: Update) -> None: ...
    def on_commit(self, record: RoundRecord) -> None: ...


SendDown = Callable[..., None]
"""`send_down(learner_id, message, *, committed_at)`: the driver's downlink. `committed_at` is the virtual
time of the commit whose broadcast the message is, or None."""


class SyncerNode:
    """The run's `Syncer`, driven on the harness's event loop (see the module docstring)."""

    def __init__(self, syncer: Syncer, *, loop: EventLoop, work: FragmentWork, shares: Sequence[float],
                 send_down: SendDown, observers: Sequence[RoundObserver] = ()) -> None:
        self.syncer = syncer
        self.loop = loop
        self.work = work
        self.shares = shares
        """Each fragment's share of the parameters: a participant's merged tokens count for that share."""
        self.send_down = send_down
        self.observers = list(observers)
        self.round_log: list[RoundRecord] = []
        self.tokens_merged = 0.0
        self.advances: list[Advance] = []
        self._deadline: float | None = None

    def receive(self, message: Any, *, learner_id: int, generation: int) -> None:
        """`message` from the live incarnation `generation` of learner `learner_id` reaches the syncer."""
        actions = self.syncer.receive(message, self.loop.now)
        if isinstance(message, Update):
            rejected = any(isinstance(a, Send) and isinstance(a.message, Rejected)
                           and a.message.learner_id == learner_id and a.message.fragment == message.fragment
                           for a in actions)
            self.work.arrived(learner_id, generation, message.fragment, message.inner_step,
                              outcome="rejected" if rejected else "accepted")
            if not rejected:
                for observer in self.observers:
                    observer.on_accepted(message)
        self._carry_out(actions)

    def _carry_out(self, actions: list) -> None:
        committed: set[tuple[int, int]] = set()
        for action in actions:
            if isinstance(action, Commit):
                self._on_commit(action.record)
                committed.add((action.record.fragment, action.record.version))
            elif isinstance(action, Send):
                message = action.message
                # Only the broadcast of a round just committed measures sync time (not, say, the
                # current fragment re-sent after a stale rejection).
                fresh = (isinstance(message, FragmentState | FragmentDelta)
                         and (message.fragment, message.version) in committed)
                self.send_down(action.learner_id, message, committed_at=self.loop.now if fresh else None)
        self._reschedule_deadline()

    def _on_commit(self, record: RoundRecord) -> None:
        self.round_log.append(record)  # durable before the sends that follow it
        share = self.shares[record.fragment]
        for participant in record.participants:
            self.work.merged(participant.learner_id, record.fragment)
            self.tokens_merged += participant.tokens * share
        self.advances.append(Advance(self.loop.now, tuple(p.learner_id for p in record.participants),
                                     sum(p.tokens for p in record.participants) * share))
        self.loop.record("commit", round=record.round_index, fragment=record.fragment, version=record.version,
                         learners=[p.learner_id for p in record.participants],
                         staleness=[p.staleness for p in record.participants], grace_s=record.grace_s)
        for observer in self.observers:
            observer.on_commit(record)

    # ---- the syncer's timer ----------------------------------------------------------------------

    def _reschedule_deadline(self) -> None:
        deadline = self.syncer.next_deadline()
        if deadline is None:
            return
        if deadline <= self.loop.now:
            # The syncer times a learner out only once strictly more than heartbeat_timeout_s has
            # passed, while next_deadline() names the instant itself: advance just after it.
            deadline = math.nextafter(self.loop.now, math.inf)
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
            self.loop.schedule(deadline, "syncer_advance", self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        self._carry_out(self.syncer.advance(self.loop.now))

    # ---- what the run reports ----------------------------------------------------------------------

    def round_metrics(self) -> dict[str, Any]:
        """Rounds committed, their mean participants and staleness, and the rejections by reason."""
        participants = [len(r.participants) for r in self.round_log]
        staleness = [p.staleness for r in self.round_log for p in r.participants]
        return {
            "rounds_committed": self.syncer.rounds_committed,
            "mean_participants_per_round": sum(participants) / len(participants) if participants else 0.0,
            "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
            "rejections": dict(sorted(self.syncer.rejection_counts.items())),
        }

    def share_of_rounds(self, learner_id: int) -> float:
        """The fraction of committed rounds (at least one) that learner `learner_id` took part in."""
        rounds = max(1, self.syncer.rounds_committed)
        return sum(1 for r in self.round_log if any(p.learner_id == learner_id for p in r.participants)) / rounds
