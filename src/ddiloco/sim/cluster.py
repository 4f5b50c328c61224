"""The simulated hardware of a harness run: how many learners, how fast each one is, how they connect.

Owns virtual step times. An inner step of learner m lasts step_time_s * (1 + slowdowns[m]) * u, with
u drawn uniformly from [1 - jitter, 1 + jitter] by the learner's own seeded generator, whatever the
real compute took: results never depend on the load of the machine that runs the harness. The
paper's mixed-hardware run (TPU v6e + v5p, about 18 % speed gap plus 10 % injected variance) is
`ClusterConfig(slowdowns=(0, 0, 0.18, 0.18), jitter=0.1)`.

One virtual second is the nominal inner step (`step_time_s = 1.0` by default), so failure and recovery
times elsewhere in `ddiloco.sim` read as "inner steps".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ddiloco.checks import invalid
from ddiloco.sim.links import LinkConfig

STEP_TIME_STREAM = 1
"""Generator stream id of step-time jitter, so it never shares draws with other seeded streams."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """M learners, their speeds, and the link between each learner and the syncer."""

    num_learners: int = 4
    """M: learners (or data-parallel replicas)."""
    step_time_s: float = 1.0
    """Virtual seconds of one inner step on a nominal learner."""
    slowdowns: tuple[float, ...] = ()
    """Per learner: extra time per inner step as a fraction (0.18 = 18 % slower); empty = all nominal."""
    jitter: float = 0.0
    """Each inner step's time is multiplied by a factor drawn uniformly from [1 - jitter, 1 + jitter]."""
    uplink: LinkConfig = field(default_factory=LinkConfig)
    """Learner -> syncer link of every learner."""
    downlink: LinkConfig = field(default_factory=LinkConfig)
    """Syncer -> learner link of every learner."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_learners, int) or self.num_learners < 1:
            raise invalid("num_learners", self.num_learners, "an integer >= 1")
        if not (math.isfinite(self.step_time_s) and self.step_time_s > 0):
            raise invalid("step_time_s", self.step_time_s, "a finite number > 0")
        if self.slowdowns and len(self.slowdowns) != self.num_learners:
            raise ValueError(f"slowdowns has {len(self.slowdowns)} entries: expected none or num_learners="
                             f"{self.num_learners}")
        if any(not (math.isfinite(s) and s > -1) for s in self.slowdowns):
            raise ValueError(f"slowdowns={self.slowdowns!r} is invalid: every entry must be a finite number > -1")
        if not 0 <= self.jitter < 1:
            raise invalid("jitter", self.jitter, "0 <= jitter < 1")

    def slowdown(self, learner_id: int) -> float:
        return self.slowdowns[learner_id] if self.slowdowns else 0.0


class StepTimer:
    """Draws the virtual duration of each inner step of one learner (or replica)."""

    def __init__(self, config: ClusterConfig, *, learner_id: int, seed: int) -> None:
        self._mean_s = config.step_time_s * (1.0 + config.slowdown(learner_id))
        self._jitter = config.jitter
        self._rng = np.random.default_rng([seed, STEP_TIME_STREAM, learner_id])

    def next_duration_s(self) -> float:
        if self._jitter == 0:
            return self._mean_s
        return self._mean_s * float(self._rng.uniform(1.0 - self._jitter, 1.0 + self._jitter))
