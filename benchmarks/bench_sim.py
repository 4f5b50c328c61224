"""Virtual-time harness benchmarks (issue 3). Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_sim.py                 # harness overhead and event-loop speed
    .venv/bin/python benchmarks/bench_sim.py --sweep         # the quality hyper-parameter sweep (~30 min)
    .venv/bin/python benchmarks/bench_sim.py --sweep --steps 1000 --only dp:2e-3 dd:2e-3:1.0:0.0:32

1. Event loop: no-op events per second through `ddiloco.sim.engine.EventLoop` (docs/architecture.md:
   about 1 M/s for heapq).
2. Harness overhead: a Decoupled DiLoCo run (M = 4, default TinyGPT, batch 8) against the same number
   of bare inner steps, interleaved, so both see the same machine load; the difference is what the
   driver, the learner and syncer cores, the codec and the evaluations cost.
3. `--sweep`: final validation loss of data-parallel (global batch 4 x 8) at several inner learning
   rates, and of Decoupled DiLoCo at several (inner lr, outer lr, outer momentum, H); the table in
   docs/results.md ("How the hyper-parameters were chosen") comes from this.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.data import SHARD_LAYOUTS, DataConfig, load_corpus, shard_stream
from ddiloco.flags import field_types
from ddiloco.sim.cluster import ClusterConfig
from ddiloco.sim.data_parallel import DataParallelSim, DataParallelSimConfig
from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig
from ddiloco.sim.engine import EventLoop
from ddiloco.sim.workload import WorkloadConfig, seeded_model
from ddiloco.training import InnerConfig, inner_step, make_inner_optimizer

DEFAULT_GRID = ("dp:1e-3", "dp:2e-3", "dp:4e-3",
                "dd:1e-3:0.7:0.9:32", "dd:2e-3:0.7:0.9:32", "dd:1e-3:0.7:0.5:32", "dd:2e-3:0.7:0.5:32",
                "dd:2e-3:0.5:0.9:32", "dd:2e-3:1.0:0.0:32", "dd:3e-3:1.0:0.0:32", "dd:2e-3:1.3:0.0:32",
                "dd:2e-3:1.0:0.0:16", "dd:2e-3:1.0:0.0:8")
"""dp:INNER_LR[:inner.FIELD=VALUE...], or dd:INNER_LR:OUTER_LR:OUTER_MOMENTUM:H[:overwrite][:FIELD=VALUE...] (the
`DilocoConfig` defaults otherwise, K = 1 + adaptive grace; `overwrite`: the overlap steps are overwritten when a round's
result arrives instead of kept; FIELD=VALUE sets any other `DilocoConfig` field, inner.FIELD=VALUE an `InnerConfig`
field such as `inner.cooldown=0.4`; the other `InnerConfig` fields keep their defaults, the 45-step warm-up among them:
`inner.warmup_steps=0` for none, as the sweeps before 2026-12-05 ran). docs/results.md, "Defaults and rounds", item 16:
`dd:3e-3:1.0:0.0:1:num_fragments=1:overlap_steps=0:codec=fp32:downlink_codec=fp32:merge=mean` moves the global model by
the mean of the learners' AdamW steps at every step; with `:0.7:0.5:16:` instead and without `merge=mean`, plain
DiLoCo."""


def bench_event_loop(events: int) -> None:
    loop = EventLoop()
    for i in range(events):
        loop.schedule(float(i % 1000), "noop", lambda: None)
    start = time.perf_counter()
    loop.run()
    elapsed = time.perf_counter() - start
    print(f"event loop: {events / elapsed / 1e6:.2f} M events/s ({events} no-op events)")


def bench_overhead(steps: int) -> None:
    workload = WorkloadConfig(data=DataConfig(batch_size=8), inner_steps=steps, eval_points=1, val_batches=2)
    corpus = load_corpus()
    sim_s, bare_s = [], []
    for _ in range(2):
        start = time.perf_counter()
        DecoupledSim(DecoupledSimConfig(workload=workload), corpus=corpus).run()
        sim_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for m in range(4):
            model = seeded_model(workload.model, m)
            optimizer = make_inner_optimizer(model, workload.inner)
            stream = shard_stream(corpus, workload.data, shard=m, num_shards=4)
            for _ in range(steps):
                inner_step(model, optimizer, stream.next_batch(), grad_clip=workload.inner.grad_clip)
        bare_s.append(time.perf_counter() - start)
    sim, bare = min(sim_s), min(bare_s)
    print(f"harness: {sim:.1f} s for 4 x {steps} inner steps vs {bare:.1f} s bare "
          f"(overhead {100 * (sim - bare) / bare:+.1f} %, including 2 evaluations)")


def _override(item: str) -> tuple[str, object]:
    """A `FIELD=VALUE` entry of a spec: the field (`DilocoConfig`'s, or `InnerConfig`'s after `inner.`) and its value,
    parsed by the field's type."""
    name, text = item.split("=", 1)
    config = InnerConfig if name.startswith("inner.") else DilocoConfig
    kind = field_types(config).get(name.removeprefix("inner."), (None, False))[0]
    if kind is None:
        raise SystemExit(f"{item!r}: {name!r} is not a scalar {config.__name__} field")
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise SystemExit(f"{item!r}: expected true or false")
        return name, text.lower() == "true"
    return name, kind(text)


def run_spec(spec: str, steps: int, evals: int, *, batch_size: int = 8, val_batches: int = 8, seed: int = 0,
             shard_layout: str = DataConfig().shard_layout, jitter: float = 0.0) -> str:
    parts = spec.split(":")
    overrides = dict(_override(p) for p in parts[2 if parts[0] == "dp" else 5:] if "=" in p)
    inner = {name.removeprefix("inner."): overrides.pop(name) for name in list(overrides) if name.startswith("inner.")}
    if parts[0] == "dp" and overrides:
        raise SystemExit(f"{spec!r}: data-parallel takes only inner.FIELD=VALUE entries")
    parts = [p for p in parts if "=" not in p]
    workload = WorkloadConfig(data=DataConfig(batch_size=batch_size, shard_layout=shard_layout),
                              inner=InnerConfig(lr=float(parts[1]), **inner),
                              inner_steps=steps, eval_points=evals, val_batches=val_batches)
    start = time.perf_counter()
    if parts[0] == "dp":
        result = DataParallelSim(DataParallelSimConfig(workload=workload, cluster=ClusterConfig(), seed=seed)).run()
    else:
        diloco = DilocoConfig(**{"sync_every": int(parts[4]), "outer_lr": float(parts[2]),
                                 "outer_momentum": float(parts[3]), "keep_overlap_work": parts[5:] != ["overwrite"],
                                 **overrides})
        result = DecoupledSim(DecoupledSimConfig(workload=workload, diloco=diloco, quorum=QuorumConfig(),
                                                 cluster=ClusterConfig(jitter=jitter), seed=seed)).run()
    curve = " ".join(f"{p.val_loss:.3f}" for p in result.curve[1:-1])
    return (f"| {spec} | {result.metrics['final_val_loss']:.4f} | {curve} | "
            f"{time.perf_counter() - start:.0f} s |")


def main(description: str | None = None) -> None:
    """`description`: the --help text of a benchmark that runs this one with a change of its own."""
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--overhead-steps", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="run the quality hyper-parameter sweep")
    parser.add_argument("--steps", type=int, default=400, help="inner steps per learner in the sweep")
    parser.add_argument("--evals", type=int, default=4, help="evaluations along each sweep run")
    parser.add_argument("--only", nargs="*", default=None, help="sweep entries to run (default: the grid)")
    parser.add_argument("--batch", type=int, default=8,
                        help="batch per learner in the sweep (8: the experiments'; 16: `ddiloco run`'s default)")
    parser.add_argument("--val-batches", type=int, default=8, help="held-out batches per evaluation in the sweep")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and timing seed of the sweep's runs")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="Decoupled learners' step times vary by up to this share (`ClusterConfig.jitter`)")
    parser.add_argument("--shard-layout", default=DataConfig().shard_layout, choices=SHARD_LAYOUTS,
                        help="how the corpus is dealt into the learners' (and data-parallel ranks') shards")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.sweep:
        bench_event_loop(args.events)
        bench_overhead(args.overhead_steps)
        return
    print(f"| config | final val loss | loss along the run | wall |  ({args.steps} inner steps per learner, "
          f"batch {args.batch}, {args.shard_layout} shards)")
    print("|---|---|---|---|")
    for spec in args.only or DEFAULT_GRID:
        print(run_spec(spec, args.steps, args.evals, batch_size=args.batch, val_batches=args.val_batches,
                       seed=args.seed, shard_layout=args.shard_layout, jitter=args.jitter), flush=True)


if __name__ == "__main__":
    main()
