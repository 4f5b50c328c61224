"""The adaptive grace window's cap and tau in the harness, on the `ddiloco experiment` set-ups (issue 12). Run by hand.

    .venv/bin/python benchmarks/bench_grace.py                                  # every case, the defaults (~5 min)
    .venv/bin/python benchmarks/bench_grace.py --only quality --cap 1 --tau 2   # the paper's one-step cap

Cases, each K = 1 + adaptive grace with the run defaults except `--cap` (`QuorumConfig.grace_max_steps`) and `--tau`
(`DilocoConfig.overlap_steps`):
- `quality`: the `quality` experiment's Decoupled run (4 learners of equal speed, no jitter, 896 inner steps).
- `heterogeneous`: the `heterogeneous` experiment's (2 of 4 learners 18 % slower, 10 % jitter, 320 steps).
- `equal`: the same without the slowdown (4 learners of equal speed, 10 % jitter).
- `failures`: the `failures` experiment's Decoupled run (its seeded fault plan).
`--margin` sets `DilocoConfig.round_margin_steps` (item 7), `--gain` `DilocoConfig.round_margin_gain` (item 9) and
`--slowdown` the heterogeneous case's slow pair.
Prints final loss, goodput, participants per round, mean staleness and rounds. On real processes,
`benchmarks/bench_runtime_quality.py -- --grace-max-steps C --overlap-steps T` measures the same choice, with the
updates that missed their round. docs/results.md ("Defaults and rounds", item 6) holds both.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.sim.experiments import HETEROGENEOUS_JITTER, HETEROGENEOUS_SLOWDOWN, _Runner, default_scale, fault_trace

CASES = {"quality": "quality", "heterogeneous": "heterogeneous", "equal": "heterogeneous", "failures": "failures"}
"""Case -> the experiment whose workload (inner steps) it runs."""


def run(case: str, *, cap: float, tau: int, seed: int, margin: float, gain: float, slowdown: float) -> dict:
    runner = _Runner(CASES[case], default_scale(), seed, progress=lambda message: None)
    quorum = QuorumConfig(min_quorum=1, grace="adaptive", grace_max_steps=cap)
    diloco = dataclasses.replace(runner.scale.diloco(), overlap_steps=tau, round_margin_steps=margin,
                                 round_margin_gain=gain)
    faults = None
    if case == "heterogeneous":
        cluster = runner.scale.cluster(4, slowdowns=(0.0, 0.0, slowdown, slowdown),
                                       jitter=HETEROGENEOUS_JITTER)
    elif case == "equal":
        cluster = runner.scale.cluster(4, jitter=HETEROGENEOUS_JITTER)
    else:
        cluster = runner.scale.cluster()
        if case == "failures":
            faults = fault_trace(runner.scale, num_learners=cluster.num_learners,
                                 steps=runner.workload.inner_steps, seed=seed)
    start = time.perf_counter()
    result = runner.decoupled(case, cluster=cluster, diloco=diloco, quorum=quorum, faults=faults)
    m = result.metrics
    return {"loss": m["final_val_loss"], "goodput": m["goodput"], "participants": m["mean_participants_per_round"],
            "staleness": m["mean_staleness"], "rounds": len(result.round_log), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(CASES), default=list(CASES))
    parser.add_argument("--cap", type=float, default=QuorumConfig().grace_max_steps,
                        help="the grace window's cap in step times (default: the run default)")
    parser.add_argument("--tau", type=int, default=DilocoConfig().overlap_steps,
                        help="overlap steps (default: the run default)")
    parser.add_argument("--margin", type=float, default=DilocoConfig().round_margin_steps,
                        help="DilocoConfig.round_margin_steps (default: the run default)")
    parser.add_argument("--gain", type=float, default=DilocoConfig().round_margin_gain,
                        help="DilocoConfig.round_margin_gain (default: the run default)")
    parser.add_argument("--slowdown", type=float, default=HETEROGENEOUS_SLOWDOWN,
                        help=f"the heterogeneous case's slow pair (default {HETEROGENEOUS_SLOWDOWN}: 18 %% slower)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cap {args.cap} steps, tau {args.tau}, margin {args.margin} steps, gain {args.gain}, "
          f"slowdown {args.slowdown}, seed {args.seed}")
    print("| case | final val loss | goodput | participants per round | mean staleness | rounds | wall |")
    print("|---|---|---|---|---|---|---|")
    for case in args.only:
        r = run(case, cap=args.cap, tau=args.tau, seed=args.seed, margin=args.margin, gain=args.gain,
                slowdown=args.slowdown)
        print(f"| {case} | {r['loss']:.4f} | {100 * r['goodput']:.1f} % | {r['participants']:.2f} | "
              f"{r['staleness']:.2f} | {r['rounds']} | {r['wall_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
