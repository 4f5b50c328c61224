"""Where learner time and bytes went, and the result record of a simulated run.

The definitions of goodput, merged work, uptime and the work categories are `ddiloco.goodput`'s, the
same for the harness and for a real chaos run: each driver books its work here (`WorkSeconds`,
`FragmentWork`), records the global model's advances and the outages, and hands the resulting
`ddiloco.goodput.EventLog` to `core_metrics`. What is the harness's own:

- **the window**: from the start of the first inner step (Decoupled learners first load the initial
  global state, which is set-up, not training) to the end of the last one; allocated learner time =
  M x its virtual duration. A learner that is down, joining, or blocked on the syncer is allocated but
  not useful.
- **work categories**: each inner step's virtual duration is split across the fragments by their share
  of the parameters, and each share ends in exactly one category of `HARNESS_CATEGORIES` (their
  meanings are `ddiloco.goodput`'s): `merged`, `overwritten` (the tau-step overlap of streaming sync,
  or a straggler overtaken by a round it did not join), `crashed` (the learner failed before
  publishing, or its update was lost in flight), `rejected`, `unfinished` (still unpublished when the
  token budget ran out) and, for data-parallel, `rolled_back`.
- **the uptime bin**: one sync period, H nominal inner steps (`uptime_bin_s`); data-parallel uses the
  H of the experiment it runs in, so every system of an experiment is measured with the same bin.
- **uptime_while_alive** (Decoupled): share of the time some learner is up in which a learner computes.
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

from ddiloco.goodput import EventLog, Work, booked_work, goodput, merged_work_fraction, uptime, work_breakdown

HARNESS_CATEGORIES = ("merged", "overwritten", "crashed", "rejected", "unfinished", "rolled_back")
"""The `ddiloco.goodput` work categories the harness books, in the order its breakdown lists them."""


class WorkSeconds:
    """Seconds of inner-step work per learner and category, as the harness books them (a learner's on-disk
    record of a real run is another thing: `ddiloco.work_ledger.WorkLedger`)."""

    def __init__(self, num_learners: int) -> None:
        self.per_learner = [dict.fromkeys(HARNESS_CATEGORIES, 0.0) for _ in range(num_learners)]

    def add(self, learner_id: int, category: str, seconds: float) -> None:
        if category not in HARNESS_CATEGORIES:
            raise ValueError(f"unknown work category {category!r}")
        self.per_learner[learner_id][category] += seconds

    def total(self, category: str) -> float:
        return sum(per[category] for per in self.per_learner)

    def records(self) -> tuple[Work, ...]:
        """The booked seconds as `ddiloco.goodput.Work` records, learner by learner."""
        return booked_work(self.per_learner)


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
        self.seconds = WorkSeconds(num_learners)
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
        self.seconds.add(learner_id, "overwritten", self.open[learner_id][fragment])
        self.open[learner_id][fragment] = 0.0

    def crashed(self, learner_id: int) -> None:
        for p in range(len(self.shares)):
            self.seconds.add(learner_id, "crashed", self.open[learner_id][p])
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
            self.seconds.add(learner_id, outcome, seconds)

    def merged(self, learner_id: int, fragment: int) -> None:
        self.seconds.add(learner_id, "merged", self._accepted.pop((learner_id, fragment)))

    def finish(self) -> None:
        """The run is over: whatever was not published or merged is unfinished."""
        for learner_id, per_fragment in enumerate(self.open):
            for p, seconds in enumerate(per_fragment):
                self.seconds.add(learner_id, "unfinished", seconds)
                per_fragment[p] = 0.0
        # After the drain nothing should be in flight or waiting in an open round; counted anyway,
        # so the booked work always adds up to the work done.
        for (learner_id, *_), seconds in list(self._in_flight.items()) + list(self._accepted.items()):
            self.seconds.add(learner_id, "unfinished", seconds)
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


def event_log(work: WorkSeconds, *, num_learners: int, start_s: float, end_s: float, uptime_bin_s: float,
              advances: Iterable = (), faults: Iterable = ()) -> EventLog:
    """The run as `ddiloco.goodput` reads it: the window, the booked work, the global model's advances and
    the outages."""
    return EventLog(num_learners=num_learners, start_s=start_s, end_s=end_s, uptime_bin_s=uptime_bin_s,
                    work=work.records(), advances=tuple(advances), faults=tuple(faults),
                    categories=HARNESS_CATEGORIES)


def core_metrics(log: EventLog, *, final_loss: float, tokens_processed: float, tokens_merged: float) -> dict[str, Any]:
    """The metrics every system reports, by the definitions of `ddiloco.goodput`."""
    return {
        "goodput": goodput(log),
        "merged_work_fraction": merged_work_fraction(log),
        "uptime": uptime(log),
        "final_val_loss": final_loss,
        "virtual_time_s": log.window_s,
        "tokens_processed": tokens_processed,
        "tokens_merged": tokens_merged,
        "work_breakdown": work_breakdown(log),
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


def add_final_point(curve: list[CurvePoint], point: CurvePoint) -> None:
    """Append the run's final evaluation to `curve`, in place of a periodic one taken at the same tokens and time (the
    last rounds may have merged since: the final value stands, and a plot shows no vertical step at the end)."""
    if curve and (curve[-1].tokens, curve[-1].time_s) == (point.tokens, point.time_s):
        curve[-1] = point
    else:
        curve.append(point)


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
    events: EventLog | None = field(default=None, repr=False)
    """The run in the `ddiloco.goodput` schema: what its goodput, uptime and recoveries are computed from."""

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "metrics": self.metrics,
                "curve": [p.to_json() for p in self.curve], "settings": self.settings}
