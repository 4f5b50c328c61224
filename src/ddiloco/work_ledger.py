"""A learner's own record on disk: its work ledger.

`WorkLedger` writes `learners/N/work.jsonl`, the record the chaos analysis and invariants read
(docs/runtime.md lists its lines): what the learner published, what became of each update, what it
received, and how much unpublished work a Welcome or the end threw away. It implements the
`ddiloco.learner_rules.WorkEvents` the rules report to.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import JsonLines
from ddiloco.learner import Learner
from ddiloco.messages import FragmentDelta, FragmentState, Update, Welcome


class WorkLedger:
    """`learners/N/work.jsonl`: one JSON object per line (`JsonLines`: appended across restarts, each line
    whole, so a kill -9 loses no line already written). Thread-safe: the main thread writes what it
    trains, publishes and receives; the sender thread writes each update's fate.

    "Unpublished" steps of fragment p are the inner steps trained since p was last published or
    last received, whichever is later: the work a Welcome or an exit throws away. The learner core
    counts steps only since the last receive, so the ledger keeps its own publish points.
    """

    def __init__(self, path: str | Path, *, num_fragments: int, inner_step: int,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._lines = JsonLines(self.path, wall_clock=wall_clock)
        self._wall_clock = wall_clock
        self._synced_at = [inner_step] * num_fragments
        """Per fragment, the inner step at which it was last published or received."""

    def write(self, event: str, **fields: Any) -> None:
        # After `close`, a sender thread that outlived it (stuck in a call) has no say: nothing is written.
        self._lines.append({"event": event, "time": self._wall_clock(), **fields})

    def unpublished(self, inner_step: int) -> list[int]:
        return [inner_step - synced for synced in self._synced_at]

    def start(self, *, inner_step: int, shares: Sequence[float]) -> None:
        self.write("start", pid=os.getpid(), inner_step=inner_step, shares=list(shares))

    def welcome(self, welcome: Welcome, *, inner_step: int, replaced: Sequence[int]) -> None:
        """`replaced`: the fragments the Welcome overwrote (a fragment still at the learner's version is kept)."""
        versions = [s.version for s in sorted(welcome.fragments, key=lambda s: s.fragment)]
        unpublished = [n if p in replaced else 0 for p, n in enumerate(self.unpublished(inner_step))]
        self.write("welcome", inner_step=inner_step, versions=versions, unpublished=unpublished)
        for p in replaced:
            self._synced_at[p] = inner_step

    def position(self, *, inner_step: int, next_round: int) -> None:
        """The learner took the global schedule position (synchronous DiLoCo, a fresh incarnation):
        its inner-step count jumps, so the publish points move with it."""
        self.write("position", inner_step=inner_step, next_round=next_round)
        self._synced_at = [inner_step] * len(self._synced_at)

    def publish(self, update: Update) -> None:
        new_steps = update.inner_step - self._synced_at[update.fragment]
        self._synced_at[update.fragment] = update.inner_step
        self.write("publish", fragment=update.fragment, base_version=update.base_version,
                   inner_step=update.inner_step, steps=update.steps, new_steps=new_steps, tokens=update.tokens)

    def fate(self, update: Update, fate: str, reason: str) -> None:
        self.write("fate", fragment=update.fragment, base_version=update.base_version, inner_step=update.inner_step,
                   fate=fate, reason=reason)

    def received(self, state: FragmentState | FragmentDelta, *, inner_step: int) -> None:
        unpublished = inner_step - self._synced_at[state.fragment]
        self._synced_at[state.fragment] = inner_step
        self.write("received", fragment=state.fragment, version=state.version, inner_step=inner_step,
                   unpublished=unpublished)

    def end(self, state: str, *, inner_step: int) -> None:
        self.write("end", inner_step=inner_step, state=state, unpublished=self.unpublished(inner_step))

    def close(self) -> None:
        self._lines.close()


def fragment_shares(learner: Learner) -> list[float]:
    """Fraction of the model's parameters (by count) in each fragment."""
    sizes = {name: p.numel() for name, p in learner.model.named_parameters()}
    counts = [sum(sizes[name] for name in names) for names in learner.plan.fragments]
    total = sum(counts)
    return [count / total for count in counts]
