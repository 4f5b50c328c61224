"""The cap on an update's norm (`QuorumConfig.max_norm_ratio`): how far healthy updates stray from their reference,
and what the cap changes in a healthy run. Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_norm_cap.py                  # quality's workload: 896 steps, 5 % jitter
    .venv/bin/python benchmarks/bench_norm_cap.py --steps 200      # a quick look

One harness run (Decoupled DiLoCo with the defaults, 4 learners, virtual time) without the cap, recording for every
update its norm (over the fragment's tensors) over the fragment's reference (the mean norm of its previous round's
updates), by how many rounds the fragment had behind it; then the same run with the cap, whose final loss is the
same to the last digit when no update was capped.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math

from ddiloco import open_round
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.data import DataConfig
from ddiloco.sim.cluster import ClusterConfig
from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig
from ddiloco.sim.workload import WorkloadConfig
from ddiloco.training import InnerConfig


class RatioRecorder:
    """Wraps `OpenRound.hold` / `record` to note each held update's norm over the fragment's previous round's."""

    def __init__(self) -> None:
        self.held: dict[int, list[float]] = collections.defaultdict(list)
        self.reference: dict[int, float] = {}
        self.rounds: collections.Counter[int] = collections.Counter()
        self.ratios: dict[int, list[float]] = collections.defaultdict(list)
        """Rounds the fragment had committed before -> the ratios of its next round's updates."""

    def install(self) -> None:
        hold, record = open_round.OpenRound.hold, open_round.OpenRound.record
        recorder = self

        def held(round_, learner_id, pending, decoded, weight):
            recorder.held[id(round_)].append(math.sqrt(sum(t.norm ** 2 for t in decoded.values())))
            return hold(round_, learner_id, pending, decoded, weight)

        def recorded(round_, *, fragment, **options):
            norms = recorder.held.pop(id(round_), [])
            reference = recorder.reference.get(fragment)
            if reference:
                recorder.ratios[recorder.rounds[fragment]] += [norm / reference for norm in norms]
            recorder.rounds[fragment] += 1
            if norms:
                recorder.reference[fragment] = sum(norms) / len(norms)
            return record(round_, fragment=fragment, **options)

        open_round.OpenRound.hold, open_round.OpenRound.record = held, recorded


def run(steps: int, seed: int, jitter: float, quorum: QuorumConfig) -> tuple[float, int]:
    """(final validation loss, updates capped) of one harness run."""
    workload = WorkloadConfig(data=DataConfig(batch_size=8), inner=InnerConfig(lr=3e-3), inner_steps=steps,
                              eval_points=4, val_batches=2)
    sim = DecoupledSim(DecoupledSimConfig(workload=workload, diloco=DilocoConfig(), quorum=quorum,
                                          cluster=ClusterConfig(jitter=jitter), seed=seed))
    result = sim.run()
    return result.metrics["final_val_loss"], sim.syncer.capped_updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=896)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter", type=float, default=0.05)
    args = parser.parse_args()
    off = dataclasses.replace(QuorumConfig(), max_norm_ratio=0.0)
    recorder = RatioRecorder()
    recorder.install()
    loss_off, _ = run(args.steps, args.seed, args.jitter, off)
    everything = sorted(r for ratios in recorder.ratios.values() for r in ratios)
    later = sorted(r for before, ratios in recorder.ratios.items() if before >= 2 for r in ratios)
    print(f"without the cap: final validation loss {loss_off:.4f}; {len(everything)} updates with a reference")
    for before in sorted(recorder.ratios)[:4]:
        print(f"  norm / reference after the fragment's round {before}: max {max(recorder.ratios[before]):.2f}")
    if later:
        print(f"  from the fragment's third round on: max {later[-1]:.2f}, p99.9 {later[int(0.999 * len(later))]:.2f}, "
              f"median {later[len(later) // 2]:.2f} ({len(later)} updates)")
    loss_on, capped = run(args.steps, args.seed, args.jitter, QuorumConfig())
    print(f"with the cap (max_norm_ratio {QuorumConfig().max_norm_ratio:g}): final validation loss {loss_on:.4f}, "
          f"{capped} updates capped")


if __name__ == "__main__":
    main()
