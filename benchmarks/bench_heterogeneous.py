"""Heterogeneous learners in the harness: the rules a slow learner follows, side by side (issue 12, item 4).

    .venv/bin/python benchmarks/bench_heterogeneous.py                    # every variant below (~35 min loaded)
    .venv/bin/python benchmarks/bench_heterogeneous.py --only paced sync  # some of them

The set-up of `ddiloco experiment heterogeneous` (4 learners, two of them 18 % slower, 10 % step-time jitter,
320 inner steps each, the run defaults): K = M (`sync`) against K = 1 + adaptive grace with the learners'
round pace on (`paced`, `DilocoConfig.pace_rounds`: a learner slower than the rounds publishes after fewer of its
own inner steps, and moves back when it leads the rounds, `Learner._follow_close`) and off (`unpaced`, the
default: only the schedule moves of a late learner), and paced with late updates weighed less
(`discounted`, `QuorumConfig.staleness_discount` = 2). Prints final loss, goodput, participants per round,
mean staleness and rounds per variant (more rounds than about 90 would mean the learners pulled the run forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ddiloco.config import QuorumConfig
from ddiloco.sim.experiments import HETEROGENEOUS_JITTER, HETEROGENEOUS_SLOWDOWN, _Runner, default_scale

VARIANTS = ("sync", "paced", "discounted", "unpaced")
DISCOUNT = 2.0
"""`discounted`: paced, and a late update weighs (1 + staleness)^-2 of a fresh one
(`QuorumConfig.staleness_discount`)."""


def run(variant: str, runner: _Runner) -> dict:
    num = 4
    cluster = runner.scale.cluster(num, slowdowns=(0.0, 0.0, HETEROGENEOUS_SLOWDOWN, HETEROGENEOUS_SLOWDOWN),
                                   jitter=HETEROGENEOUS_JITTER)
    quorum = (QuorumConfig(min_quorum=num, grace="none") if variant == "sync"
              else QuorumConfig(min_quorum=1, grace="adaptive",
                                staleness_discount=DISCOUNT if variant == "discounted" else 0.0))
    start = time.perf_counter()
    diloco = dataclasses.replace(runner.scale.diloco(), pace_rounds=variant in ("paced", "discounted"))
    result = runner.decoupled(variant, cluster=cluster, diloco=diloco, quorum=quorum)
    m = result.metrics
    return {"variant": variant, "loss": m["final_val_loss"], "goodput": m["goodput"],
            "participants": m["mean_participants_per_round"], "staleness": m["mean_staleness"],
            "rounds": len(result.round_log), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner = _Runner("heterogeneous", default_scale(), args.seed, progress=lambda message: None)
    print("| variant | final val loss | goodput | participants per round | mean staleness | rounds | wall |")
    print("|---|---|---|---|---|---|---|")
    for variant in args.only:
        r = run(variant, runner)
        print(f"| {r['variant']} | {r['loss']:.4f} | {100 * r['goodput']:.1f} % | {r['participants']:.2f} | "
              f"{r['staleness']:.2f} | {r['rounds']} | {r['wall_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
