"""Fault plans for the virtual-time harness: when each learner is down, explicit or drawn at random.

Owns the failure side of a simulated run and nothing else: a `FaultPlan` is a sorted tuple of
`Outage(learner_id, start_s, end_s)`, at most one at a time per learner; what a failure costs a system
is the driver's business (`ddiloco.sim.decoupled`, `ddiloco.sim.data_parallel`). Every system of an
experiment runs under the same plan, so they face exactly the same failures.

The failure model is `ddiloco.failures.FailureModel`, the one of the Decoupled DiLoCo chaos experiments
(Douillard et al., arXiv 2604.21428, section 4) that the planner uses too, scaled down to a handful of
learners (`HARNESS_FAILURES`): each learner is one unit that fails as a Poisson process with mean time
between interruptions `mtbi_s` (counted while it is up), and comes back after an exponentiated-Weibull
recovery time. Its values are in units of the harness's nominal inner step of one virtual second: a
learner fails about once per 400 inner steps and stays down for 15 s on average (scale 10 s, k = 0.8,
alpha = 1.5: median about 10 s, 90th percentile about 34 s, capped at 300 s). With four learners that puts non-elastic
data-parallel in the regime of the paper's 150 k - 300 k chip columns (goodput 57-72 %), which is where
the paper's Decoupled DiLoCo keeps more than 90 %.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ddiloco.failures import FailureModel
from ddiloco.goodput import Fault


@dataclass(frozen=True, order=True)
class Outage:
    """Learner `learner_id` is down on [start_s, end_s) of virtual time."""

    start_s: float
    learner_id: int
    end_s: float

    def __post_init__(self) -> None:
        if self.learner_id < 0:
            raise ValueError(f"learner_id={self.learner_id} is invalid: expected an integer >= 0")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"start_s={self.start_s!r} is invalid: expected a finite number >= 0")
        if not (math.isfinite(self.end_s) and self.end_s > self.start_s):
            raise ValueError(f"end_s={self.end_s!r} is invalid: expected a finite number > start_s={self.start_s}")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict:
        return {"learner": self.learner_id, "start_s": self.start_s, "end_s": self.end_s}


@dataclass(frozen=True)
class FaultPlan:
    """Every outage of a run, sorted by start time. Overlapping outages of one learner are refused."""

    outages: tuple[Outage, ...] = ()

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.outages))
        object.__setattr__(self, "outages", ordered)
        last_end: dict[int, float] = {}
        for outage in ordered:
            if outage.start_s < last_end.get(outage.learner_id, -math.inf):
                raise ValueError(f"outages of learner {outage.learner_id} overlap at {outage.start_s} s: "
                                 "merge them into one")
            last_end[outage.learner_id] = outage.end_s

    @classmethod
    def of(cls, outages: Iterable[tuple[int, float, float]]) -> FaultPlan:
        """From (learner_id, start_s, end_s) triples."""
        return cls(tuple(Outage(start, learner, end) for learner, start, end in outages))

    def for_learner(self, learner_id: int) -> list[Outage]:
        return [o for o in self.outages if o.learner_id == learner_id]

    def is_down(self, learner_id: int, time_s: float) -> bool:
        return any(o.start_s <= time_s < o.end_s for o in self.for_learner(learner_id))

    def down_s(self, learner_id: int, until_s: float) -> float:
        """Seconds learner `learner_id` is down within [0, until_s)."""
        return sum(max(0.0, min(o.end_s, until_s) - o.start_s) for o in self.for_learner(learner_id))

    def to_json(self) -> list[dict]:
        return [o.to_json() for o in self.outages]


def outage_faults(plan: FaultPlan) -> tuple[Fault, ...]:
    """The plan's outages as `ddiloco.goodput` faults (a learner down from start to end, then back)."""
    return tuple(Fault(o.learner_id, o.start_s, o.end_s) for o in plan.outages)


HARNESS_FAILURES = FailureModel(mtbi_s=400.0, chips_per_slice=1, recovery_scale_s=10.0, recovery_shape=0.8,
                                recovery_exponent=1.5, max_recovery_s=300.0)
"""The harness's failure model (the module docstring): a learner is one unit that fails about once per
400 nominal inner steps and stays down for about 15 s."""


def harness_failures(**changes: float) -> FailureModel:
    """`HARNESS_FAILURES` with some fields changed."""
    return dataclasses.replace(HARNESS_FAILURES, **changes)


def draw_fault_plan(model: FailureModel, *, num_learners: int, horizon_s: float, seed: int,
                    max_down_at_once: int | None = None) -> FaultPlan:
    """Outages starting before `horizon_s`, learner by learner, from one seeded generator.

    `max_down_at_once` (default: num_learners - 1) drops a failure that would leave fewer than
    num_learners - max_down_at_once learners up, so that a small run keeps someone alive; the paper's
    clusters have enough learners that "all down at once" does not happen.
    """
    if num_learners < 1:
        raise ValueError(f"num_learners={num_learners} is invalid: expected an integer >= 1")
    limit = num_learners - 1 if max_down_at_once is None else max_down_at_once
    rng = np.random.default_rng(seed)
    candidates = []
    for learner_id in range(num_learners):
        t = 0.0
        while True:
            t += rng.exponential(model.mtbi_s)
            if t >= horizon_s:
                break
            duration = model.sample_recovery_s(rng)
            candidates.append(Outage(t, learner_id, t + duration))
            t += duration
    kept: list[Outage] = []
    for outage in sorted(candidates):
        overlapping = sum(1 for o in kept if o.start_s <= outage.start_s < o.end_s)
        if overlapping < limit:
            kept.append(outage)
    return FaultPlan(tuple(kept))
