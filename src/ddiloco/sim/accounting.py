"""Where learner time and bytes went, and the result record of a simulated run.

Owns the definitions of the harness's metrics, shared by every system:

- **allocated learner time** = M x the run's virtual duration, from the start of the first inner step
  (Decoupled learners first load the initial global state, which is set-up, not training) to the end
  of the last one. A learner that is down, joining, or blocked on the syncer is allocated but not
  useful.
- **work categories**: each inner step's virtual duration is split across the fragments by their share
  of the parameters, and each share ends in exactly one category:
  `merged` (it reached the global model through a committed round), `overwritten` (a newer version of
  the fragment arrived before the learner published it: the tau-step overlap of streaming sync, or a
  straggler overtaken by a round it did not join), `crashed` (the learner failed before publishing, or
  its update was lost in flight), `rejected` (the syncer refused the update, e.g. stale), `unfinished`
  (still unpublished when the token budget ran out), and, for data-parallel, `rolled_back` (undone by
  a restart from a checkpoint).
- **goodput** = (merged + overwritten + unfinished) / allocated: time spent computing inner steps
  that the system did not throw away (lost to a failure, a rejection or a rollback), over allocated
  time. Overwritten work counts because it steered the learner's other fragments, and the paper's
  goodput (100 % at K = 1) counts it; unfinished work counts because the run ends at a token budget,
  an artefact of the harness, not a cost of the system (a longer run would merge it). The strict
  **merged_work_fraction** = merged / allocated is reported beside it, and `work_breakdown` gives
  every category.
- **uptime** = share of the run's virtual duration in which at least one learner (or the
  data-parallel job) is computing an inner step: the global model is being trained.
- **tokens processed** = target tokens of every completed inner step; **tokens merged** = sum over
  committed rounds of each participant's tokens x its fragment's share of the parameters (the
  protocol's own counters: tokens since the learner last received that fragment).
- **peak bytes per step**: payload bytes (pseudo-gradients up, fragments down; not joins) that a single
  learner's link carried in one direction within one nominal inner-step window of virtual time,
  maximised over learners and over the steady-state windows: after the first sync period (H steps)
  and before the token budget runs out. The start-up (the syncer has no step-time estimate yet, so
  the adaptive grace window is 0 and every early update closes its own round) and the final flush
  (learners leave and every open round closes at once) send several fragments in one window;
  **max_bytes_per_step** includes them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

WORK_CATEGORIES = ("merged", "overwritten", "crashed", "rejected", "unfinished", "rolled_back")
USEFUL_CATEGORIES = ("merged", "overwritten", "unfinished")


class WorkLedger:
    """Seconds of inner-step work per learner and category."""

    def __init__(self, num_learners: int) -> None:
        self.seconds = [dict.fromkeys(WORK_CATEGORIES, 0.0) for _ in range(num_learners)]

    def add(self, learner_id: int, category: str, seconds: float) -> None:
        if category not in WORK_CATEGORIES:
            raise ValueError(f"unknown work category {category!r}")
        self.seconds[learner_id][category] += seconds

    def total(self, category: str) -> float:
        return sum(per[category] for per in self.seconds)

    def useful(self) -> float:
        return sum(self.total(c) for c in USEFUL_CATEGORIES)

    def breakdown(self, allocated_s: float) -> dict[str, float]:
        """Share of allocated time per category."""
        if allocated_s <= 0:
            return dict.fromkeys(WORK_CATEGORIES, 0.0)
        return {c: self.total(c) / allocated_s for c in WORK_CATEGORIES}


class FragmentWork:
    """Follows every learner's inner-step work, fragment by fragment, into its work category.

    A step's duration is split across fragments by their parameter shares and sits in the learner's
    open work for that fragment until the fragment is published (the work travels with the update),
    overwritten by a newer version, or lost in a crash. An update in flight is keyed by
    (learner, incarnation, fragment, inner step); once the syncer accepts it into a round it is keyed
    by (learner, fragment), since the syncer holds at most one update per learner and fragment.
    """

    def __init__(self, shares: list[float], num_learners: int) -> None:
        self.shares = shares
        self.ledger = WorkLedger(num_learners)
        self.open = [[0.0] * len(shares) for _ in range(num_learners)]
        self._in_flight: dict[tuple[int, int, int, int], float] = {}
        self._accepted: dict[tuple[int, int], float] = {}

    def step(self, learner_id: int, seconds: float) -> None:
        for p, share in enumerate(self.shares):
            self.open[learner_id][p] += seconds * share

    def published(self, learner_id: int, incarnation: int, fragment: int, inner_step: int) -> None:
        self._in_flight[(learner_id, incarnation, fragment, inner_step)] = self.open[learner_id][fragment]
        self.open[learner_id][fragment] = 0.0

    def overwritten(self, learner_id: int, fragment: int) -> None:
        self.ledger.add(learner_id, "overwritten", self.open[learner_id][fragment])
        self.open[learner_id][fragment] = 0.0

    def crashed(self, learner_id: int) -> None:
        for p in range(len(self.shares)):
            self.ledger.add(learner_id, "crashed", self.open[learner_id][p])
            self.open[learner_id][p] = 0.0

    def arrived(self, learner_id: int, incarnation: int, fragment: int, inner_step: int, *,
                outcome: str) -> None:
        """An update reached the syncer (outcome 'accepted' or 'rejected') or was lost ('crashed')."""
        seconds = self._in_flight.pop((learner_id, incarnation, fragment, inner_step))
        if outcome == "accepted":
            # A second update accepted into the same open round joins the first (the syncer combines a
            # held late update with new work, or replaces it with the same work continued).
            key = (learner_id, fragment)
            self._accepted[key] = self._accepted.get(key, 0.0) + seconds
        else:
            self.ledger.add(learner_id, outcome, seconds)

    def merged(self, learner_id: int, fragment: int) -> None:
        self.ledger.add(learner_id, "merged", self._accepted.pop((learner_id, fragment)))

    def finish(self) -> None:
        """The run is over: whatever was not published or merged is unfinished."""
        for learner_id, per_fragment in enumerate(self.open):
            for p, seconds in enumerate(per_fragment):
                self.ledger.add(learner_id, "unfinished", seconds)
                per_fragment[p] = 0.0
        # After the drain nothing should be in flight or waiting in an open round; counted anyway,
        # so the ledger always adds up to the work done.
        for (learner_id, *_), seconds in list(self._in_flight.items()) + list(self._accepted.items()):
            self.ledger.add(learner_id, "unfinished", seconds)
        self._in_flight.clear()
        self._accepted.clear()


def union_length(intervals: Iterable[tuple[float, float]], *, end_s: float = math.inf) -> float:
    """Length of the union of [start, stop) intervals, clipped to [0, end_s)."""
    total, reach = 0.0, -math.inf
    for start, stop in sorted(intervals):
        start, stop = max(start, reach, 0.0), min(stop, end_s)
        if stop > start:
            total += stop - start
            reach = stop
    return total


class PeakMeter:
    """Bytes per learner per window of `window_s` virtual seconds; `peak` is the largest window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._bytes: dict[tuple[int, int], int] = defaultdict(int)

    def add(self, learner_id: int, time_s: float, nbytes: int) -> None:
        if nbytes:
            self._bytes[(learner_id, int(time_s // self.window_s))] += nbytes

    def peak(self, start_s: float = 0.0, end_s: float = math.inf) -> int:
        """The largest window that lies inside [start_s, end_s)."""
        return max((n for (_, window), n in self._bytes.items()
                    if start_s <= window * self.window_s and (window + 1) * self.window_s <= end_s), default=0)


def core_metrics(ledger: WorkLedger, *, num_learners: int, start_s: float, end_s: float,
                 busy: Iterable[tuple[float, float]], final_loss: float, tokens_processed: float,
                 tokens_merged: float) -> dict[str, Any]:
    """The metrics every system reports, by the definitions in the module docstring. `busy` holds the
    intervals in which a learner (or the data-parallel job) computed."""
    duration_s = end_s - start_s
    allocated_s = num_learners * duration_s
    busy_s = union_length(busy, end_s=end_s)
    return {
        "goodput": ledger.useful() / allocated_s if allocated_s else 0.0,
        "merged_work_fraction": ledger.total("merged") / allocated_s if allocated_s else 0.0,
        "uptime": busy_s / duration_s if duration_s else 0.0,
        "final_val_loss": final_loss,
        "virtual_time_s": duration_s,
        "tokens_processed": tokens_processed,
        "tokens_merged": tokens_merged,
        "work_breakdown": ledger.breakdown(allocated_s),
    }


@dataclass
class CurvePoint:
    tokens: int
    """Tokens processed (Decoupled) or kept in the model (data-parallel) when evaluated."""
    time_s: float
    """Virtual time of the evaluation."""
    val_loss: float

    def to_json(self) -> dict[str, float]:
        return {"tokens": self.tokens, "time_s": self.time_s, "val_loss": self.val_loss}


@dataclass
class SimResult:
    """Everything a simulated run produced. `metrics` is flat and JSON-ready."""

    system: str
    metrics: dict[str, Any]
    curve: list[CurvePoint]
    log: list[dict[str, Any]] = field(repr=False)
    final_params: Mapping[str, torch.Tensor] = field(repr=False)
    round_log: list = field(default_factory=list, repr=False)
    """RoundRecords of a Decoupled run (empty for data-parallel)."""
    settings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "metrics": self.metrics,
                "curve": [p.to_json() for p in self.curve], "settings": self.settings}
