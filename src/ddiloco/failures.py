"""The one failure model: Poisson interruptions and exponentiated-Weibull recovery times.

Shared by the scale planner (`ddiloco.plan`: chips of a large cluster, slices that go down together),
the virtual-time harness (`ddiloco.sim.faults`: a learner is one unit that fails) and the chaos runs'
drawn plans (`ddiloco.chaos.plan.model_plan`). It is the model of the Decoupled DiLoCo
chaos-engineering experiments (Douillard et al., arXiv 2604.21428, section 4): interruptions form a
Poisson process of rate units / mtbi_s, and a failed unit comes back after a recovery time drawn from
F(x) = (1 - exp(-(x / scale)^k))^alpha, sampled by inversion x = scale * (-log(1 - u^(1/alpha)))^(1/k)
and capped at max_recovery_s. With k < 1 the tail is heavy (a few long repairs), with alpha > 1 very
short recoveries are rare. The defaults are the planner's calibrated values (docs/planning.md); the
harness scales them down (`ddiloco.sim.faults.HARNESS_FAILURES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.checks import require_int, require_positive

SECONDS_PER_YEAR = 365.25 * 24 * 3600
"""The paper quotes the per-chip mean time between interruptions in years."""

RECOVERY_MEAN_GRID_POINTS = 200_001
"""Points of the trapezoid rule that integrates the recovery survival function (mean to < 0.01 %)."""

RECOVERY_MEAN_GRID_SCALES = 60.0
"""The integration grid reaches this many scale parameters; the survival function is ~0 beyond."""


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """How units (chips, learners) fail and come back. Defaults are the calibrated values of docs/planning.md."""

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
    max_recovery_s: float | None = None
    """Recovery times are capped here (None: not capped), so one unlucky draw cannot take a unit away for
    a whole short run."""

    def __post_init__(self) -> None:
        for name, unit in (("mtbi_s", "seconds"), ("recovery_scale_s", "seconds"), ("recovery_shape", "dimensionless"),
                           ("recovery_exponent", "dimensionless")):
            require_positive(name, getattr(self, name), unit)
        require_int("chips_per_slice", self.chips_per_slice, minimum=1)
        if self.max_recovery_s is not None:
            require_positive("max_recovery_s", self.max_recovery_s, "seconds; or none: not capped")

    def failure_rate_per_s(self, chips: float) -> float:
        """Interruptions per second among `chips` units (each one takes its slice down)."""
        return chips / self.mtbi_s

    def recovery_cdf(self, x: np.ndarray) -> np.ndarray:
        """F(x) = (1 - exp(-(x / scale)^k))^alpha for x >= 0 (before the cap)."""
        z = np.maximum(np.asarray(x, dtype=np.float64), 0.0) / self.recovery_scale_s
        return (-np.expm1(-(z ** self.recovery_shape))) ** self.recovery_exponent

    def recovery_mean_s(self) -> float:
        """Mean recovery time: the integral of the survival function 1 - F(x) up to the cap."""
        high = RECOVERY_MEAN_GRID_SCALES * self.recovery_scale_s
        if self.max_recovery_s is not None:
            high = min(high, self.max_recovery_s)
        x = np.linspace(0.0, high, RECOVERY_MEAN_GRID_POINTS)
        survival = 1.0 - self.recovery_cdf(x)
        return float(np.sum((survival[1:] + survival[:-1]) * np.diff(x)) / 2)

    def lost_capacity_fraction(self) -> float:
        """Expected share of chips inside slices that are down (Little's law on the slices).

        Each interruption keeps chips_per_slice chips away for one recovery time on average, whatever
        the cluster size: chips_per_slice * mean recovery / mtbi_s.
        """
        return self.chips_per_slice * self.recovery_mean_s() / self.mtbi_s

    def sample_recoveries_s(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` recovery times by inversion of F, capped at max_recovery_s."""
        u = rng.random(count)
        x = self.recovery_scale_s * (-np.log1p(-(u ** (1.0 / self.recovery_exponent)))) ** (
            1.0 / self.recovery_shape)
        return x if self.max_recovery_s is None else np.minimum(x, self.max_recovery_s)

    def sample_recovery_s(self, rng: np.random.Generator) -> float:
        """One recovery time (the same draw as one element of `sample_recoveries_s`)."""
        return float(self.sample_recoveries_s(rng, 1)[0])
