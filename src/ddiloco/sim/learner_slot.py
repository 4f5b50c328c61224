"""One learner id of the Decoupled DiLoCo harness across its incarnations (`ddiloco.sim.decoupled`).

Owns what the driver keeps per learner id: its links in both directions, its step timer and data shard
(which outlive a failure: a new incarnation's data cursor continues where the failed one stopped), the
current incarnation's `Learner` core and `LearnerRules`, its state between events, the generation that
tells a dead incarnation's events from the live one's, and what the run reports per learner (compute and
up intervals, time blocked, inner steps, tokens, incarnations, waits abandoned). It also owns the seed rule
of a new incarnation's model. When the slot's events happen, and what they do to the syncer and the
books, is the driver's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddiloco.learner import Learner
from ddiloco.learner_rules import LearnerRules
from ddiloco.sim.cluster import StepTimer
from ddiloco.sim.links import Link

INCARNATION_SEED_STRIDE = 1_000_003
"""Seeds of learner models are seed + 1 + learner_id + stride * incarnation: distinct from the global
model's seed, and different for every incarnation (a fresh model after a failure)."""


@dataclass
class LearnerSlot:
    """The driver's view of one learner id across its incarnations."""

    learner_id: int
    uplink: Link
    downlink: Link
    timer: StepTimer
    stream: Any
    learner: Learner | None = None
    rules: LearnerRules | None = None
    state: str = "down"  # joining | stepping | blocked | down | done
    generation: int = 0  # bumped on every failure: events of a dead incarnation are ignored
    syncer_generation: int = -1  # incarnation whose Join the syncer has processed
    inbox: list = field(default_factory=list)
    step_started_at: float = 0.0
    wait_started_at: float = 0.0
    wait_token: int = 0
    step_intervals: list[tuple[float, float]] = field(default_factory=list)
    up_intervals: list[tuple[float, float]] = field(default_factory=list)
    up_since: float | None = None
    blocked_s: float = 0.0
    steps_done: int = 0
    tokens_processed: int = 0
    incarnations: int = 0
    waits_abandoned: int = 0

    def model_seed(self, seed: int) -> int:
        """The seed of the next incarnation's model in a run seeded with `seed` (`INCARNATION_SEED_STRIDE`)."""
        return seed + 1 + self.learner_id + INCARNATION_SEED_STRIDE * self.incarnations

    def unblock(self, now: float) -> None:
        """A blocked learner may step again: the time it waited counts as blocked."""
        if self.state == "blocked":
            self.blocked_s += now - self.wait_started_at
            self.state = "ready"

    def close_up_interval(self, now: float) -> None:
        if self.up_since is not None:
            self.up_intervals.append((self.up_since, now))
            self.up_since = None

    def crash(self, now: float) -> None:
        """The incarnation is gone: its core, its inbox and what its links carried are lost."""
        self.generation += 1
        self.state = "down"
        self.learner = None
        self.rules = None
        self.inbox.clear()
        self.uplink.reset(now)
        self.downlink.reset(now)
