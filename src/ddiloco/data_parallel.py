"""What every data-parallel baseline shares: the ring all-reduce's cost, and which steps a restart keeps.

The bandwidth planner (`ddiloco.plan.bandwidth`), the virtual-time harness (`ddiloco.sim.data_parallel`)
and the real DDP job of a chaos run (`ddiloco.chaos.data_parallel`, `ddiloco.chaos.dp_worker`, and the
chaos analysis) all use these, so the cost and the accounting are written once.

- **Ring all-reduce** of `nbytes` over k replicas: each replica sends (and receives) 2 (k - 1) / k of the
  bytes through its link, in 2 (k - 1) hops that each pay the link's latency. One replica needs none.
- **Kept steps** of a job restarted from checkpoints: the steps attempt a computed are kept up to the step
  attempt a + 1 resumed from (the rest was rolled back), the last attempt's up to the model the job ends
  with (`final_step`; None: all of them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

BITS_PER_BYTE = 8


def ring_share(replicas: int) -> float:
    """Share of the bytes every replica sends (and receives) in one ring all-reduce: 2 (k - 1) / k."""
    return 2 * (replicas - 1) / replicas if replicas > 1 else 0.0


def ring_allreduce_bytes(replicas: int, nbytes: float) -> float:
    """Bytes each replica sends (and receives) in one ring all-reduce of `nbytes`."""
    return ring_share(replicas) * nbytes if replicas > 1 else 0.0


def ring_allreduce_s(replicas: int, nbytes: float, *, latency_s: float, bandwidth_bps: float = math.inf) -> float:
    """Seconds of one ring all-reduce of `nbytes` over links of `latency_s` and `bandwidth_bps` bits per
    second (inf: only the latency counts)."""
    if replicas <= 1:
        return 0.0
    return ring_share(replicas) * nbytes * BITS_PER_BYTE / bandwidth_bps + 2 * (replicas - 1) * latency_s


@dataclass(frozen=True)
class StepAccount:
    """Global steps of a job over all its attempts."""

    computed: int
    """Steps computed, counting a step computed again after a rollback each time."""
    kept: int
    """Steps in the model the job ends with."""

    @property
    def rolled_back(self) -> int:
        return self.computed - self.kept


def account_steps(steps: Iterable[tuple[int, int]], from_steps: Mapping[int, int], *,
                  final_step: int | None = None) -> StepAccount:
    """Computed and kept steps (the module docstring) from the (attempt, global step) of every step the job
    computed (each once) and `from_steps`: attempt -> the step it resumed from. A step of an attempt that
    is not in `from_steps` counts as kept up to `final_step` (a log whose start was lost)."""
    order = sorted(from_steps)
    resumed_at = {a: from_steps[b] for a, b in zip(order, order[1:], strict=False)}
    last = math.inf if final_step is None else final_step
    computed = kept = 0
    for attempt, step in steps:
        computed += 1
        if step <= resumed_at.get(attempt, last):
            kept += 1
    return StepAccount(computed=computed, kept=kept)
