"""Heterogeneous learners in the harness: the rules a slow learner follows, side by side (issue 12, item 4).

    .venv/bin/python benchmarks/bench_heterogeneous.py                    # every variant below (~35 min loaded)
    .venv/bin/python benchmarks/bench_heterogeneous.py --only paced sync  # some of them
    .venv/bin/python benchmarks/bench_heterogeneous.py --only sync unpaced --inner-lr 2e-3 --warmup-steps 0

The set-up of `ddiloco experiment heterogeneous` (4 learners, two of them 18 % slower, 10 % step-time jitter,
320 inner steps each, the run defaults): K = M (`sync`) against K = 1 + adaptive grace with the learners'
round pace on (`paced`, `DilocoConfig.pace_rounds`: a learner slower than the rounds publishes after fewer of its
own inner steps, and moves back when it leads the rounds, `Learner._follow_close`) and off (`unpaced`, the
default: only the schedule moves of a late learner), and paced with late updates weighed less
(`discounted`, `QuorumConfig.staleness_discount` = 2). Prints final loss, goodput, participants per round,
mean staleness and rounds per variant (more rounds than about 90 would mean the learners pulled the run forward).
`equal_time`: the default (`unpaced`) given the tokens its learners process in the virtual time K = M needs for
the budget (K = M idles its fast learners, so in that time K = 1 trains about 1 / goodput more); runs `sync` first
if it is not in `--only`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ddiloco.config import QuorumConfig
from ddiloco.sim.experiments import HETEROGENEOUS_JITTER, HETEROGENEOUS_SLOWDOWN, _Runner, default_scale

VARIANTS = ("sync", "paced", "discounted", "unpaced", "equal_time")
SLOWDOWNS = (0.0, 0.0, HETEROGENEOUS_SLOWDOWN, HETEROGENEOUS_SLOWDOWN)
DISCOUNT = 2.0
"""`discounted`: paced, and a late update weighs (1 + staleness)^-2 of a fresh one
(`QuorumConfig.staleness_discount`)."""


def equal_time_steps(virtual_time_s: float, step_time_s: float) -> int:
    """Inner steps per learner that spend, at the learners' mean speeds, the tokens they process in `virtual_time_s`."""
    return round(virtual_time_s / step_time_s * sum(1.0 / (1.0 + s) for s in SLOWDOWNS) / len(SLOWDOWNS))


def run(variant: str, runner: _Runner, *, inner_steps: int | None = None) -> dict:
    num = len(SLOWDOWNS)
    cluster = runner.scale.cluster(num, slowdowns=SLOWDOWNS, jitter=HETEROGENEOUS_JITTER)
    quorum = (QuorumConfig(min_quorum=num, grace="none") if variant == "sync"
              else QuorumConfig(min_quorum=1, grace="adaptive",
                                staleness_discount=DISCOUNT if variant == "discounted" else 0.0))
    start = time.perf_counter()
    diloco = dataclasses.replace(runner.scale.diloco(), pace_rounds=variant in ("paced", "discounted"))
    workload = None if inner_steps is None else dataclasses.replace(runner.workload, inner_steps=inner_steps)
    result = runner.decoupled(variant, cluster=cluster, diloco=diloco, quorum=quorum, workload=workload)
    m = result.metrics
    return {"variant": variant if inner_steps is None else f"{variant} ({inner_steps} steps)",
            "loss": m["final_val_loss"], "goodput": m["goodput"], "virtual_time_s": m["virtual_time_s"],
            "participants": m["mean_participants_per_round"], "staleness": m["mean_staleness"],
            "rounds": len(result.round_log), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inner-lr", type=float, default=None, help="the inner rate (default: the run default)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="its warm-up (default: the run default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = default_scale()
    if args.inner_lr is not None:
        scale = dataclasses.replace(scale, inner_lr=args.inner_lr)
    if args.warmup_steps is not None:
        scale = dataclasses.replace(scale, warmup_steps=args.warmup_steps)
    runner = _Runner("heterogeneous", scale, args.seed, progress=lambda message: None)
    print("| variant | final val loss | goodput | participants per round | mean staleness | rounds | virtual time | "
          "wall |")
    print("|---|---|---|---|---|---|---|---|")
    variants = list(args.only)
    if "equal_time" in variants and "sync" not in variants[:variants.index("equal_time")]:
        variants.insert(variants.index("equal_time"), "sync")
    sync_time_s = None
    for variant in variants:
        if variant == "equal_time":
            steps = equal_time_steps(sync_time_s, runner.scale.cluster().step_time_s)
            r = run("unpaced", runner, inner_steps=steps)
        else:
            r = run(variant, runner)
        if variant == "sync":
            sync_time_s = r["virtual_time_s"]
        print(f"| {r['variant']} | {r['loss']:.4f} | {100 * r['goodput']:.1f} % | {r['participants']:.2f} | "
              f"{r['staleness']:.2f} | {r['rounds']} | {r['virtual_time_s']:.0f} s | {r['wall_s']:.0f} s |",
              flush=True)


if __name__ == "__main__":
    main()
