"""The failure process of a large cluster and the timelines it produces; no system logic.

Owns the hardware side of the goodput simulator (`ddiloco.plan.goodput`): chips fail as a Poisson
process, a failed chip takes its whole slice down, and the slice comes back after a recovery time
drawn from an exponentiated Weibull distribution, which is the model of the Decoupled DiLoCo
chaos-engineering experiments (Douillard et al., arXiv 2604.21428, section "goodput"). Interval
arithmetic on the resulting timelines lives in `ddiloco.plan.timeline`; what a failure costs each
system lives in `ddiloco.plan.goodput`. Nothing here knows what a learner is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddiloco.checks import require

SECONDS_PER_YEAR = 365.25 * 24 * 3600
"""The paper quotes the per-chip mean time between interruptions in years."""

RECOVERY_MEAN_GRID_POINTS = 200_001
"""Points of the trapezoid rule that integrates the recovery survival function (mean to < 0.01 %)."""

RECOVERY_MEAN_GRID_SCALES = 60.0
"""The integration grid reaches this many scale parameters; the survival function is ~0 beyond."""


def _positive(field: str, value: float, unit: str) -> None:
    require(isinstance(value, int | float) and math.isfinite(value) and value > 0, field, value,
             f"a finite number > 0 ({unit})")


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """How chips fail and come back. Defaults are the calibrated values of docs/planning.md."""

    mtbi_s: float = SECONDS_PER_YEAR
    """Mean time between interruptions of one chip, in seconds (the paper: one year). Interruptions
    of all chips together form a Poisson process of rate chips / mtbi_s."""
    chips_per_slice: int = 256
    """Chips that go down together when one of them fails (a slice, the unit of elastic resizing)."""
    recovery_scale_s: float = 2400.0
    """Scale of the exponentiated Weibull time for a failed slice to return, in seconds."""
    recovery_shape: float = 0.8
    """Weibull shape k of the recovery time (< 1: a heavy tail of long repairs)."""
    recovery_exponent: float = 1.5
    """Exponent alpha of the exponentiated Weibull (> 1: fewer very short recoveries)."""

    def __post_init__(self) -> None:
        _positive("mtbi_s", self.mtbi_s, "seconds")
        require(isinstance(self.chips_per_slice, int) and self.chips_per_slice >= 1, "chips_per_slice",
                 self.chips_per_slice, "an integer >= 1")
        _positive("recovery_scale_s", self.recovery_scale_s, "seconds")
        _positive("recovery_shape", self.recovery_shape, "dimensionless")
        _positive("recovery_exponent", self.recovery_exponent, "dimensionless")

    def failure_rate_per_s(self, chips: float) -> float:
        """Interruptions per second among `chips` chips (each one takes its slice down)."""
        return chips / self.mtbi_s

    def recovery_mean_s(self) -> float:
        """Mean recovery time: the integral of the survival function 1 - F(x)."""
        x = np.linspace(0.0, RECOVERY_MEAN_GRID_SCALES * self.recovery_scale_s, RECOVERY_MEAN_GRID_POINTS)
        survival = 1.0 - exponentiated_weibull_cdf(x, self)
        return float(np.sum((survival[1:] + survival[:-1]) * np.diff(x)) / 2)

    def lost_capacity_fraction(self) -> float:
        """Expected share of chips inside slices that are down (Little's law on the slices).

        Each interruption keeps chips_per_slice chips away for one recovery time on average, whatever
        the cluster size: chips_per_slice * mean recovery / mtbi_s.
        """
        return self.chips_per_slice * self.recovery_mean_s() / self.mtbi_s


def exponentiated_weibull_cdf(x: np.ndarray, model: FailureModel) -> np.ndarray:
    """F(x) = (1 - exp(-(x / scale)^k))^alpha for x >= 0."""
    z = np.maximum(np.asarray(x, dtype=np.float64), 0.0) / model.recovery_scale_s
    return (-np.expm1(-(z ** model.recovery_shape))) ** model.recovery_exponent


def sample_recovery_s(rng: np.random.Generator, count: int, model: FailureModel) -> np.ndarray:
    """`count` recovery times by inversion: x = scale * (-log(1 - u^(1/alpha)))^(1/k)."""
    u = rng.random(count)
    return model.recovery_scale_s * (-np.log1p(-(u ** (1.0 / model.recovery_exponent)))) ** (
        1.0 / model.recovery_shape)


def poisson_times(rng: np.random.Generator, rate_per_s: float, start_s: float, end_s: float) -> np.ndarray:
    """Sorted event times of a Poisson process of `rate_per_s` on [start_s, end_s)."""
    count = rng.poisson(rate_per_s * (end_s - start_s))
    return np.sort(rng.uniform(start_s, end_s, count))
