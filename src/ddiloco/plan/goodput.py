"""Goodput and uptime of data-parallel, elastic data-parallel and Decoupled DiLoCo at scale.

A fast simulator of the chaos-engineering experiments of Decoupled DiLoCo (Douillard et al.,
arXiv 2604.21428): 10 k to millions of chips, failures as a Poisson process with exponentiated
Weibull recovery (`ddiloco.plan.failures`), each system a few timelines measured as integrals
(`ddiloco.plan.systems`, `ddiloco.plan.timeline`). No process per chip, no event queue: one replica
of 8 k failures takes milliseconds.

Goodput = useful chip-seconds / allocated chip-seconds; uptime = share of wall time in which the
global model advances (the definitions of `ddiloco.goodput`, measured here exactly on the timelines
rather than in bins of discrete rounds); both with 95 % Student-t intervals over independent, seeded replicas. This
module owns the estimates and the entry point `simulate`; the configs are in `ddiloco.plan.scenario`,
the calibrated grid in `ddiloco.plan.paper_grid`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddiloco.checks import invalid
from ddiloco.plan.scenario import Scenario, SimulationConfig
from ddiloco.plan.systems import SIMULATORS

SYSTEMS = tuple(SIMULATORS)
SYSTEM_LABELS = {
    "data_parallel": "data-parallel, no elasticity",
    "elastic_data_parallel": "data-parallel, elastic",
    "decoupled": "Decoupled DiLoCo",
}

T_QUANTILE_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                  2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
"""Student t 97.5 % quantiles for 1..20 degrees of freedom: two-sided 95 % confidence intervals
over replicas without a SciPy dependency."""

NORMAL_QUANTILE_975 = 1.960
"""The t quantile's limit, used beyond 20 degrees of freedom."""

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Estimate:
    """A mean over replicas and its two-sided 95 % confidence interval."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: np.ndarray, *, lowest: float = -math.inf, highest: float = math.inf) -> Estimate:
        """The Student t interval over `values`, cut to [lowest, highest], the values the quantity can take
        (a share: [0, 1]). The t interval is symmetric, so with few replicas near a bound it reaches past it
        (goodput -0.03 %); the quantity's true value lies inside the bounds, so cutting them off keeps every
        value the interval covered and its coverage with them. A transformed interval (logit) would instead
        fail on replicas at exactly 0 or 1, which are common (uptime 1 with quorum 1)."""
        values = np.asarray(values, dtype=np.float64)
        mean = float(values.mean())
        dof = len(values) - 1
        quantile = T_QUANTILE_975[dof - 1] if dof <= len(T_QUANTILE_975) else NORMAL_QUANTILE_975
        half = quantile * float(values.std(ddof=1)) / math.sqrt(len(values))
        # min/max with the mean: a mean a rounding past a bound stays inside its own interval.
        return cls(mean, min(max(mean - half, lowest), mean), max(min(mean + half, highest), mean))

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class GoodputResult:
    """One system in one scenario. Goodput and uptime are fractions (0..1)."""

    system: str
    chips: int
    learners: int
    goodput: Estimate
    uptime: Estimate
    tokens_per_hour: Estimate
    horizon_s: float

    def to_dict(self) -> dict:
        return {"system": self.system, "chips": self.chips, "learners": self.learners,
                "goodput": self.goodput.to_dict(), "uptime": self.uptime.to_dict(),
                "tokens_per_hour": self.tokens_per_hour.to_dict(), "horizon_s": self.horizon_s}


def horizon_for(scenario: Scenario, sim: SimulationConfig) -> float:
    """Seconds of simulated training that hold `sim.failures` interruptions of the base chips."""
    return sim.failures / scenario.failures.failure_rate_per_s(scenario.layout.chips)


def simulate(system: str, scenario: Scenario, sim: SimulationConfig) -> GoodputResult:
    """Goodput, uptime and tokens per hour of `system`, with 95 % intervals over replicas."""
    if system not in SIMULATORS:
        raise invalid("system", system, f"one of {', '.join(SYSTEMS)}")
    horizon_s = horizon_for(scenario, sim)
    layout = scenario.layout
    samples = []
    for replica in range(sim.replicas):
        entropy = [sim.seed, SYSTEMS.index(system), layout.chips, layout.learners, replica]
        rng = np.random.default_rng(np.random.SeedSequence(entropy))
        samples.append(SIMULATORS[system](rng, scenario, horizon_s))
    goodput = np.array([s.useful_chip_s / s.allocated_chip_s for s in samples])
    uptime = np.array([s.advancing_s / s.horizon_s for s in samples])
    tokens_per_hour = np.array([s.tokens / (s.horizon_s / SECONDS_PER_HOUR) for s in samples])
    return GoodputResult(system, layout.chips, layout.learners, Estimate.of(goodput, lowest=0.0, highest=1.0),
                         Estimate.of(uptime, lowest=0.0, highest=1.0), Estimate.of(tokens_per_hour, lowest=0.0),
                         horizon_s)
