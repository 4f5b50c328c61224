"""Fault plans for the virtual-time harness: when each learner is down, explicit or drawn at random.

Owns the failure side of a simulated run and nothing else. The plan is the one `ddiloco.fault_plan.FaultPlan`
of chaos runs too, restricted to outages (a learner down on [start, end): a crash held down,
`FaultPlan.of((learner, start_s, end_s), ...)`), at most one at a time per learner; what a failure costs a
system is the driver's business (`ddiloco.sim.decoupled`, `ddiloco.sim.data_parallel`). Every system of an
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

import numpy as np

from ddiloco.failures import FailureModel
from ddiloco.fault_plan import Fault, FaultPlan
from ddiloco.goodput import FaultSpan


def harness_plan(plan: FaultPlan | None, num_learners: int) -> FaultPlan:
    """`plan` (None: no faults) checked for what the harness simulates: outages of its learners."""
    plan = plan or FaultPlan()
    other = sorted({f.kind if f.kind != "crash" else "crash with restart true" for f in plan.faults if not f.is_outage})
    if other:
        raise ValueError(f"fault plan kinds {', '.join(other)} are invalid for the harness: expected outages only "
                         "(crash with restart false and a duration)")
    if any(f.target is None or f.target >= num_learners for f in plan.outages):
        raise ValueError(f"fault plan names a learner beyond num_learners={num_learners}")
    return plan


def outages_json(plan: FaultPlan) -> list[dict]:
    """The plan as a harness result records it: [{"learner", "start_s", "end_s"}, ...] (replay reads it back)."""
    return [{"learner": o.target, "start_s": o.at_s, "end_s": o.end_s} for o in plan.outages]


def outage_faults(plan: FaultPlan) -> tuple[FaultSpan, ...]:
    """The plan's outages as `ddiloco.goodput` faults (a learner down from start to end, then back)."""
    return tuple(FaultSpan(o.target, o.at_s, o.end_s) for o in plan.outages)


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
            candidates.append(Fault(at_s=t, kind="crash", target=learner_id, duration_s=duration, restart=False))
            t += duration
    kept: list[Fault] = []
    for outage in sorted(candidates, key=lambda f: (f.at_s, f.target, f.end_s)):
        overlapping = sum(1 for o in kept if o.at_s <= outage.at_s < o.end_s)
        if overlapping < limit:
            kept.append(outage)
    return FaultPlan(faults=tuple(kept))
