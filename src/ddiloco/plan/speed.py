"""How learner speed differences turn into idle time, for a given minimum quorum.

Owns the speed side of the goodput simulator: which learners run on slower hardware, and how long
the faster ones wait when a round needs K of them. Decoupled DiLoCo (arXiv 2604.21428) with K = 1
never makes a learner wait; K = M is synchronous and every learner goes at the pace of the slowest
one, which is also how a data-parallel job runs on mixed hardware. The paper's mixed-hardware run
(4 learners on TPU v6e + 4 on v5p, about 18 % speed gap plus 10 % injected variance) measured 84 %
goodput at K = 8 and 100 % at K = 1.

Model: in every round each learner needs (1 + slowdown_m) * (1 + spread * z) time units for its
share of inner steps, z standard normal. The round closes when the K-th fastest learner is done; a
learner that finished earlier waits for it, a slower one does not hold anyone up. Slack that the
tau-step overlap could absorb is ignored, so the waits are an upper bound. Failures are not part of
this model: `ddiloco.plan.goodput` multiplies the busy fraction found here into each learner's
failure-free time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPEED_ROUNDS = 4000
"""Rounds drawn to estimate the waits: the busy fraction to about 0.1 % at 10 % spread."""

MIN_ROUND_TIME = 0.05
"""A round never takes less than 5 % of its nominal time, whatever the noise draw (keeps the
normal noise of a large spread from producing zero or negative durations)."""


@dataclass(frozen=True)
class SpeedProfile:
    """Per learner: share of its time it computes (the rest it waits) and its rate relative to a
    nominal learner that never waits (rounds per nominal round time)."""

    busy_fraction: np.ndarray
    rate: np.ndarray


def learner_slowdowns(learners: int, slow_fraction: float, slowdown: float) -> np.ndarray:
    """Relative extra time per round of each learner: the last round(slow_fraction * M) are slower."""
    slow = int(round(slow_fraction * learners))
    out = np.zeros(learners)
    if slow:
        out[learners - slow:] = slowdown
    return out


def quorum_speed(rng: np.random.Generator, slowdowns: np.ndarray, quorum: int, spread: float,
                 rounds: int = SPEED_ROUNDS) -> SpeedProfile:
    """Busy fraction and rate of each learner when every round waits for the `quorum`-th fastest."""
    learners = len(slowdowns)
    if not 1 <= quorum <= learners:
        raise ValueError(f"quorum={quorum} is invalid: expected 1 <= quorum <= {learners} learners")
    if spread == 0 and not np.any(slowdowns):
        return SpeedProfile(np.ones(learners), np.ones(learners))
    noise = np.maximum(1.0 + spread * rng.standard_normal((rounds, learners)), MIN_ROUND_TIME)
    work_RM = (1.0 + slowdowns)[None, :] * noise  # (rounds, M) time each learner needs per round
    closes_R = np.partition(work_RM, quorum - 1, axis=1)[:, quorum - 1]
    elapsed_RM = np.maximum(work_RM, closes_R[:, None])
    busy = work_RM.sum(axis=0) / elapsed_RM.sum(axis=0)
    rate = rounds / elapsed_RM.sum(axis=0)
    return SpeedProfile(busy, rate)
