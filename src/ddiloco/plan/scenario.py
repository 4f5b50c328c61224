"""What the goodput simulator is asked: the run's layout, reconfiguration costs, scavenging, budget.

Plain, frozen, validated configs; the hardware's failure model is `ddiloco.plan.failures.FailureModel`.
The defaults are the calibrated values of docs/planning.md, which reproduce the goodput grid of
Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) within 4 points per cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddiloco.checks import require, require_at_least
from ddiloco.plan.failures import MAX_SLICES_DOWN, FailureModel, max_chips


@dataclass(frozen=True, kw_only=True)
class ReconfigurationCosts:
    """What a change of hardware costs; defaults are the calibrated values of docs/planning.md."""

    downscale_s: float = 10.0
    """Seconds an elastic job (or one learner) is paused to drop a failed slice."""
    upscale_s: float = 10.0
    """Seconds an elastic job (or one learner) is paused to take a returned slice back."""
    restart_s: float = 75.0
    """Seconds a data-parallel job without elasticity needs to restart after a failure (reschedule
    onto a replacement slice, reload the checkpoint)."""
    checkpoint_interval_s: float = 0.0
    """Training seconds between two checkpoints of data-parallel; the progress since the last one is
    lost at a failure. 0: a checkpoint every inner step (in-memory redundancy), nothing lost."""
    join_s: float = 30.0
    """Seconds a Decoupled DiLoCo learner that joins (a scavenged one) needs to load the global state
    before it trains."""

    def __post_init__(self) -> None:
        for name in ("downscale_s", "upscale_s", "restart_s", "checkpoint_interval_s", "join_s"):
            require_at_least(name, getattr(self, name), 0.0, "seconds")


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """The training run: chips, learners, quorum and how fast each learner is."""

    chips: int = 1_200_000
    """Chips of the run (all learners together; data-parallel uses them as one job)."""
    learners: int = 8
    """M: Decoupled DiLoCo learners, each on chips / M chips. For data-parallel, the hardware groups
    whose speeds differ (see slow_learner_fraction)."""
    min_quorum: int = 1
    """K: a Decoupled DiLoCo round needs this many learners (capped at the learners present)."""
    slow_learner_fraction: float = 0.0
    """Share of the learners on slower hardware (0.5: half of them)."""
    slow_learner_slowdown: float = 0.0
    """Extra time per inner step of the slow learners (0.18: 18 % slower)."""
    step_time_spread: float = 0.0
    """Relative standard deviation of a learner's time per round (0.1: 10 % injected variance)."""
    tokens_per_chip_s: float = 1000.0
    """Tokens one chip of nominal speed trains per second; only scales the tokens-per-hour figure
    (set it to your model's measured throughput)."""

    def __post_init__(self) -> None:
        require(isinstance(self.chips, int) and self.chips >= 1, "chips", self.chips, "an integer >= 1")
        require(isinstance(self.learners, int) and 1 <= self.learners <= self.chips, "learners",
                 self.learners, f"an integer between 1 and chips={self.chips}")
        require(isinstance(self.min_quorum, int) and 1 <= self.min_quorum <= self.learners, "min_quorum",
                 self.min_quorum, f"an integer between 1 and learners={self.learners}")
        require(0.0 <= self.slow_learner_fraction <= 1.0, "slow_learner_fraction", self.slow_learner_fraction,
                 "a share between 0 and 1")
        require_at_least("slow_learner_slowdown", self.slow_learner_slowdown, 0.0, "relative extra step time")
        require_at_least("step_time_spread", self.step_time_spread, 0.0, "relative standard deviation")
        require(math.isfinite(self.tokens_per_chip_s) and self.tokens_per_chip_s > 0, "tokens_per_chip_s",
                 self.tokens_per_chip_s, "a finite number > 0 (tokens per chip-second)")

    @property
    def chips_per_learner(self) -> float:
        return self.chips / self.learners


@dataclass(frozen=True, kw_only=True)
class ScavengeConfig:
    """Spare capacity that comes and goes: extra learners of chips / M chips each."""

    extra_learners: int = 0
    """Extra learners (Decoupled DiLoCo) or extra slices of the same size (elastic data-parallel)."""
    availability: float = 0.5
    """Share of the run during which each extra learner is available."""
    window_s: float = 6 * 3600.0
    """Mean length of one availability window, in seconds (windows and gaps are exponential)."""

    def __post_init__(self) -> None:
        require(isinstance(self.extra_learners, int) and self.extra_learners >= 0, "extra_learners",
                 self.extra_learners, "an integer >= 0")
        require(0.0 < self.availability <= 1.0, "availability", self.availability, "a share in (0, 1]")
        require(math.isfinite(self.window_s) and self.window_s > 0, "window_s", self.window_s,
                 "a finite number > 0 (seconds)")


MAX_FAILURES = 1_000_000
"""Most interruptions one replica simulates: its draws are of this order (1e6: 34 s and 1 GB here; 1e12 asked NumPy for
7.28 TiB)."""


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """How much to simulate: more failures and replicas give narrower confidence intervals."""

    failures: int = 8000
    """Interruptions per replica, across the whole run; the simulated horizon is failures divided by
    the cluster's interruption rate (8000 at 1.2 M chips: about 2.4 days)."""
    replicas: int = 5
    """Independent replicas; the confidence intervals are Student t over replicas."""
    seed: int = 0
    """Seed of every random draw; the same seed gives bitwise the same results."""

    def __post_init__(self) -> None:
        require(isinstance(self.failures, int) and 10 <= self.failures <= MAX_FAILURES, "failures", self.failures,
                f"an integer between 10 and {MAX_FAILURES:,} (more replicas narrow the intervals too)")
        require(isinstance(self.replicas, int) and self.replicas >= 2, "replicas", self.replicas,
                 "an integer >= 2 (a confidence interval needs two)")
        require(isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "an integer >= 0")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Everything one simulated run needs."""

    layout: LayoutConfig = field(default_factory=LayoutConfig)
    failures: FailureModel = field(default_factory=FailureModel)
    costs: ReconfigurationCosts = field(default_factory=ReconfigurationCosts)
    scavenge: ScavengeConfig = field(default_factory=ScavengeConfig)

    def __post_init__(self) -> None:
        most = max_chips(self.failures)
        if self.layout.chips > most:
            raise ValueError(f"chips={self.layout.chips} is invalid: expected at most {most:.3g} chips with this "
                             f"failure model (mtbi_s={self.failures.mtbi_s:g}), which has {MAX_SLICES_DOWN:.0e} "
                             "slices down at once there, the most one draw can count; use fewer chips")
        recovery_s = self.failures.recovery_mean_s()
        if not math.isfinite(recovery_s):
            raise ValueError(f"recovery_scale_s={self.failures.recovery_scale_s:g} is invalid: the mean recovery it "
                             f"gives is {recovery_s} s, not a finite number; give a recovery scale in seconds a real "
                             "slice takes (the default is 2400)")
        down_per_slice = self.failures.lost_capacity_fraction()
        if down_per_slice >= 1.0:
            raise ValueError(f"chips_per_slice={self.failures.chips_per_slice} is invalid: the failure model keeps "
                             f"more chips down than the cluster has ({down_per_slice:.3g} slices down per slice on "
                             "average: "
                             f"a chip fails once in {self.failures.mtbi_s:g} s and takes its slice of "
                             f"{self.failures.chips_per_slice} chips down for {self.failures.recovery_mean_s():.4g} s "
                             "on average); use smaller slices (--chips-per-slice), a longer --mtbi-s or shorter "
                             "recoveries (--recovery-scale-s)")
        if self.failures.chips_per_slice > self.layout.chips_per_learner:
            raise ValueError(f"chips_per_slice={self.failures.chips_per_slice} is invalid: a learner has only "
                             f"{self.layout.chips_per_learner:g} chips (chips={self.layout.chips}, "
                             f"learners={self.layout.learners}); use fewer learners or smaller slices")
