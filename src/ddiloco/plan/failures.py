"""The failure process of a large cluster and the timelines it produces; no system logic.

Owns the hardware side of the goodput simulator (`ddiloco.plan.goodput`): chips fail as a Poisson
process, a failed chip takes its whole slice down, and the slice comes back after a recovery time
drawn from an exponentiated Weibull distribution, which is the model of the Decoupled DiLoCo
chaos-engineering experiments (Douillard et al., arXiv 2604.21428, section "goodput"); the model itself
is `ddiloco.failures.FailureModel`, shared with the harness and the chaos runs. Interval
arithmetic on the resulting timelines lives in `ddiloco.plan.timeline`; what a failure costs each
system lives in `ddiloco.plan.goodput`. Nothing here knows what a learner is.
"""

from __future__ import annotations

import numpy as np

from ddiloco.failures import SECONDS_PER_YEAR, FailureModel

__all__ = ["SECONDS_PER_YEAR", "FailureModel", "exponentiated_weibull_cdf", "poisson_times", "sample_recovery_s"]


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
