"""Would learners train closer to data-parallel if their AdamW moments were shared? (docs/results.md, "Defaults and
rounds", item 18; a measurement, nothing landed.)

Item 16 traced the gap to data-parallel to each learner's own AdamW on a quarter of data-parallel's batch, and item 17
found that correcting a learner's second moment from its own statistics does not help. This is the upper bound of the
other remedy, the one papers on local adaptive optimizers propose (averaging the optimizer states across learners at
a sync): an oracle that costs no bytes in the harness. Each time a learner takes a fragment's new version, the AdamW
moments of that fragment's parameters (`MOMENTS`: `m`, `v` or `mv`) are set, in every live learner, to their mean
over the live learners. If even the oracle does not close the gap, averaging the moments over the wire (2-3 times the
uplink's bytes) is not worth building.

    MOMENTS=mv .venv/bin/python benchmarks/bench_shared_moments.py --sweep --steps 896 --evals 6 --seed 0 \
        --jitter 0.05 --only dd:3e-3:0.7:0.5:16

Any `benchmarks/bench_sim.py` arguments are passed on; only the Decoupled learners' moments are touched.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_sim  # noqa: E402

from ddiloco.sim.decoupled import DecoupledSim  # noqa: E402

MOMENTS = os.environ.get("MOMENTS", "mv")
KEYS = [key for letter, key in (("m", "exp_avg"), ("v", "exp_avg_sq")) if letter in MOMENTS]

_apply = DecoupledSim._apply


@torch.no_grad()
def _apply_and_share(self: DecoupledSim, slot, message) -> None:
    learner = slot.learner
    before = list(learner.versions) if learner is not None else []
    _apply(self, slot, message)
    if learner is None or slot.learner is not learner:
        return
    moved = [p for p, (old, new) in enumerate(zip(before, learner.versions, strict=True)) if new > old >= 0]
    live = [s.learner for s in self.slots if s.learner is not None and s.state not in ("down", "done")]
    if not moved or len(live) < 2:
        return
    parameters = [dict(other.model.named_parameters()) for other in live]
    for p in moved:
        for name in self.syncer.plan.fragments[p]:
            states = [other.optimizer.state.get(params[name]) for other, params in zip(live, parameters, strict=True)]
            if any(not state for state in states):
                continue
            for key in KEYS:
                mean = torch.stack([state[key] for state in states]).mean(0)
                for state in states:
                    state[key].copy_(mean)


if __name__ == "__main__":
    DecoupledSim._apply = _apply_and_share
    print(f"moments shared at every fragment's new version: {', '.join(KEYS) or 'none (the control)'}")
    bench_sim.main(__doc__)
