"""The failure process of a large cluster and the timelines it produces; no system logic.

Owns the hardware side of the goodput simulator (`ddiloco.plan.goodput`): chips fail as a Poisson
process, a failed chip takes its whole slice down, and the slice comes back after a recovery time
drawn from an exponentiated Weibull distribution, which is the model of the Decoupled DiLoCo
chaos-engineering experiments (Douillard et al., arXiv 2604.21428, section "goodput"); the model itself
is `ddiloco.failures.FailureModel`, shared with the harness and the chaos runs. Interval
arithmetic on the resulting timelines lives in `ddiloco.plan.timeline`; what a failure costs each
system lives in `ddiloco.plan.goodput`. Nothing here knows what a learner is.

Every draw is of the order of the failures inside the simulated horizon, whatever the chip count: the
horizon shrinks as the cluster grows, and the slices already down when it starts are drawn from the
steady state (`steady_state_down`) rather than by simulating a warm-up before it, which at 1e12 chips
would be 3e9 failures.
"""

from __future__ import annotations

import numpy as np

from ddiloco.failures import RECOVERY_MEAN_GRID_SCALES, SECONDS_PER_YEAR, FailureModel

__all__ = ["MAX_SLICES_DOWN", "SECONDS_PER_YEAR", "FailureModel", "exponentiated_weibull_cdf", "max_chips",
           "poisson_times", "sample_recovery_s", "steady_state_down", "survival", "survival_integral_s"]

SURVIVAL_GRID_POINTS = 4001
"""Points of the trapezoid rule for the integral of the recovery survival function: within 1e-5 of the
200 k-point mean of `FailureModel.recovery_mean_s` (default model), in 0.03 ms, so it can run per group."""

MAX_SLICES_DOWN = 1e18
"""Most slices a cluster may have down at once on average (chips / mtbi_s * mean recovery): their
count is one Poisson draw, and NumPy draws Poisson counts only up to about 9.2e18 (int64)."""


def exponentiated_weibull_cdf(x: np.ndarray, model: FailureModel) -> np.ndarray:
    """F(x) = (1 - exp(-(x / scale)^k))^alpha for x >= 0."""
    return model.recovery_cdf(x)


def sample_recovery_s(rng: np.random.Generator, count: int, model: FailureModel) -> np.ndarray:
    """`count` recovery times by inversion: x = scale * (-log(1 - u^(1/alpha)))^(1/k)."""
    return model.sample_recoveries_s(rng, count)


def poisson_times(rng: np.random.Generator, rate_per_s: float, start_s: float, end_s: float) -> np.ndarray:
    """Sorted event times of a Poisson process of `rate_per_s` on [start_s, end_s)."""
    count = rng.poisson(rate_per_s * (end_s - start_s))
    return np.sort(rng.uniform(start_s, end_s, count))


def survival(x: np.ndarray, model: FailureModel) -> np.ndarray:
    """P(recovery > x): 1 - F(x) below the cap, 0 at and beyond it (a capped draw equals the cap)."""
    x = np.asarray(x, dtype=np.float64)
    out = 1.0 - model.recovery_cdf(x)
    return out if model.max_recovery_s is None else np.where(x < model.max_recovery_s, out, 0.0)


def survival_integral_s(model: FailureModel, from_s: float) -> float:
    """The integral of P(recovery > x) over x >= from_s (trapezoid rule; from_s = 0: the mean recovery)."""
    high = RECOVERY_MEAN_GRID_SCALES * model.recovery_scale_s
    if model.max_recovery_s is not None:
        high = min(high, model.max_recovery_s)
    if from_s >= high:
        return 0.0
    x = np.linspace(from_s, high, SURVIVAL_GRID_POINTS)
    s = survival(x, model)
    return float(np.sum((s[1:] + s[:-1]) * np.diff(x)) / 2)


def max_chips(model: FailureModel) -> float:
    """The most chips the simulator takes with `model`: MAX_SLICES_DOWN slices down at once on average."""
    return MAX_SLICES_DOWN * model.mtbi_s / survival_integral_s(model, 0.0)


def steady_state_down(rng: np.random.Generator, rate_per_s: float, horizon_s: float,
                      model: FailureModel) -> tuple[int, np.ndarray]:
    """Slices that failed before 0 and are still down at 0, in steady state: (how many, the sorted times in
    [0, horizon_s) at which some of them return).

    A failure at -s (s > 0) whose recovery R exceeds s returns at R - s > 0. Failures of rate r before 0, each
    kept with P(R > s), give returns at t >= 0 as a Poisson process of intensity r * S(t), S the survival
    function of R (M/G/infinity in steady state). So the returns inside the horizon are the process of rate r
    on [0, horizon_s) thinned by S (Lewis-Shedler: about r * horizon_s draws, the failures inside the horizon),
    and the slices that return later are only counted, Poisson with mean r times the integral of S beyond
    horizon_s. Both are exact (that mean up to its quadrature, 1e-5); drawing every failure of a warm-up
    window instead costs r * window draws.
    """
    candidates = poisson_times(rng, rate_per_s, 0.0, horizon_s)
    returns = candidates[rng.random(len(candidates)) < survival(candidates, model)]
    later = int(rng.poisson(rate_per_s * survival_integral_s(model, horizon_s)))
    return len(returns) + later, returns
