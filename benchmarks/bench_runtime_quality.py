"""Real processes: default ddiloco against synchronous data-parallel at equal tokens (issue 12). Run by hand.

    .venv/bin/python benchmarks/bench_runtime_quality.py                    # 4 learners, 300 inner steps (~8 min)
    .venv/bin/python benchmarks/bench_runtime_quality.py --steps 200 -- --outer-lr 1.0 --outer-momentum 0
    .venv/bin/python benchmarks/bench_runtime_quality.py --steps 896 -- --data-shard-layout interleaved
    .venv/bin/python benchmarks/bench_runtime_quality.py --steps 896 --skip-ddiloco --dp-inner-lr 4e-3

1. `ddiloco run --learners M --inner-steps N` (the built-in TinyGPT learner, the syncer, the evaluator; gRPC on
   127.0.0.1), with the defaults unless flags after `--` change them. Its final validation loss is the
   evaluator's last `eval/val_loss` (after every learner's last round), its curve the evaluator's metrics.
2. The DDP baseline `ddiloco chaos` runs (`ddiloco.chaos.data_parallel.DataParallelJob`: M ranks over gloo,
   shard r for rank r, global batch M x B), without faults, stopped once rank 0 has taken N steps (the job
   evaluates at its last step): the same tokens, model, data and seed (the data and inner-optimizer settings of
   the ddiloco run's resolved config: `--data-*` and `--inner-*` flags after `--` apply to both), except the inner
   learning rate where `--dp-inner-lr` gives it one of its own (data-parallel's best rate need not be ddiloco's;
   docs/results.md, "Defaults and rounds", item 15). `--skip-ddiloco` runs the baseline alone, with the default
   data and inner settings (no flags after `--`).

Also printed: the updates that missed their round (the round's result does not name them, so they were merged one
version late in a later round) and when each was published against that round's close, and the learners' waits
(docs/results.md, "Defaults and rounds", item 6, chose the grace window's cap from these).

Acceptance (issue 12): ddiloco within 2 % of data-parallel in final validation loss, and never a validation
loss above the starting loss. Both run one after the other on this machine; wall times are printed but
not compared (on 2 cores the DDP ranks and the learners compete for the same cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddiloco.chaos.data_parallel import DataParallelAgentConfig, DataParallelJob
from ddiloco.data import DataConfig
from ddiloco.run_config import RunConfig
from ddiloco.training import InnerConfig

TOLERANCE = 0.02


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def run_ddiloco(run_dir: Path, *, learners: int, steps: int, seed: int, extra: list[str]) -> dict:
    command = [sys.executable, "-c", "from ddiloco.cli import main; main()", "run", "--learners", str(learners),
               "--inner-steps", str(steps), "--seed", str(seed), "--threads", "1", "--run-dir", str(run_dir),
               "--eval-every-s", "5", *extra]
    start = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    curve = [(r["step"], r["eval/val_loss"]) for r in jsonl(run_dir / "evaluator" / "metrics.jsonl")
             if "eval/val_loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    rounds = jsonl(run_dir / "rounds.jsonl")
    participants = [len(r["participants"]) for r in rounds]
    return {"final": summary["final_val_loss"], "curve": [v for _, v in curve], "rounds": len(rounds),
            "participants": sum(participants) / max(1, len(participants)), "wall_s": time.monotonic() - start,
            "missed": missed_rounds(run_dir),
            "config": json.loads((run_dir / "config.json").read_text(encoding="utf-8"))}


def missed_rounds(run_dir: Path) -> dict:
    """Which updates a round's result left out, and when each was published against that round's close: from the
    learners' work ledgers (wall time) and the round log (the syncer's monotonic clock, the same on this machine
    as the offset between the two clocks read now). An update for version v of fragment p was meant for the round
    that made v + 1; missed when that round's participants do not name it (it was folded into a later one).
    Also the learners' waits for a round's result (their `wait_s` metrics)."""
    offset = time.time() - time.monotonic()
    rounds = {(r["fragment"], r["version"]): r for r in jsonl(run_dir / "rounds.jsonl")}
    published, late_s = 0, []
    for ledger in sorted((run_dir / "learners").glob("*/work.jsonl")):
        learner = int(ledger.parent.name)
        for line in jsonl(ledger):
            meant = rounds.get((line.get("fragment"), line.get("base_version", -2) + 1))
            if line.get("event") != "publish" or meant is None:
                continue
            published += 1
            if not any(p["learner_id"] == learner and p["base_version"] == line["base_version"]
                       for p in meant["participants"]):
                late_s.append(line["time"] - offset - meant["closed_at"])
    waits = [v for m in sorted((run_dir / "learners").glob("*/metrics.jsonl")) for r in jsonl(m)
             for k, v in r.items() if k.endswith("/wait_s")]
    late_s.sort()
    return {"published": published, "missed": len(late_s), "waits": len(waits), "wait_s": sum(waits),
            "late_s": [late_s[min(len(late_s) - 1, int(q * len(late_s)))] for q in (0.5, 0.9)] + late_s[-1:]
            if late_s else []}


def run_data_parallel(job_dir: Path, run_config: RunConfig, *, steps: int) -> dict:
    job = DataParallelJob(DataParallelAgentConfig(eval_every_s=5.0), run_config=run_config, job_dir=job_dir)
    start = time.monotonic()
    job.start()
    try:
        while True:
            job.poll()
            if job.failure is not None:
                raise RuntimeError(f"the data-parallel job failed: {job.failure}")
            records = jsonl(job.paths.rank_metrics(0))
            if records and max(r.get("step", 0) for r in records) >= steps:
                break
            time.sleep(0.2)
    finally:
        summary = job.stop()
    records = jsonl(job.paths.rank_metrics(0))
    curve = [r["dp/val_loss"] for r in records if "dp/val_loss" in r]
    return {"final": summary["final_val_loss"], "final_step": summary["final_step"], "curve": curve,
            "wall_s": time.monotonic() - start}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="inner steps per learner (= DDP steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-dp", action="store_true", help="only the ddiloco run")
    parser.add_argument("--skip-ddiloco", action="store_true", help="only the data-parallel baseline")
    parser.add_argument("--dp-inner-lr", type=float, default=None,
                        help="the baseline's inner learning rate (default: the ddiloco run's)")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.skip_ddiloco and (extra or args.skip_dp):
        parser.error("--skip-ddiloco runs the baseline alone at the default settings: no --skip-dp, no flags after --")
    with tempfile.TemporaryDirectory(prefix="bench_runtime_quality_") as tmp:
        root = Path(tmp)
        # The data and inner-optimizer settings of the ddiloco run (batch, shard layout, learning rate, its warm-up
        # and cooldown over the same steps), so that both systems read the same shards at the same rates.
        run_config = RunConfig(num_learners=args.learners, inner_steps=args.steps, seed=args.seed)
        dd = None
        if not args.skip_ddiloco:
            dd = run_ddiloco(root / "ddiloco", learners=args.learners, steps=args.steps, seed=args.seed, extra=extra)
            report_ddiloco(dd, extra)
            run_config = dataclasses.replace(run_config, data=DataConfig(**dd["config"]["data"]),
                                             inner=InnerConfig(**dd["config"]["inner"]))
        if args.skip_dp:
            return
        if args.dp_inner_lr is not None:
            run_config = dataclasses.replace(run_config, inner=dataclasses.replace(run_config.inner,
                                                                                   lr=args.dp_inner_lr))
        dp = run_data_parallel(root / "data_parallel", run_config, steps=args.steps)
        print(f"data-parallel (DDP, gloo, {args.learners} ranks, inner lr {run_config.inner.lr:g}): final "
              f"{dp['final']:.4f} at step {dp['final_step']}, {dp['wall_s']:.0f} s", flush=True)
        print(f"  curve {' '.join(f'{v:.3f}' for v in dp['curve'])}")
        if dd is not None:
            gap = dd["final"] / dp["final"] - 1
            print(f"ddiloco vs data-parallel: {gap:+.2%} (within {TOLERANCE:.0%}: {gap <= TOLERANCE}); never above "
                  f"the starting loss: {max(dd['curve'][1:]) <= dd['curve'][0]}")


def report_ddiloco(dd: dict, extra: list[str]) -> None:
    diloco = dd["config"]["diloco"]
    print(f"ddiloco ({' '.join(extra) or 'defaults'}; outer {diloco['outer_lr']}, {diloco['outer_momentum']}, "
          f"H {diloco['sync_every']}, downlink {diloco['downlink_codec']}, inner lr {dd['config']['inner']['lr']:g}): "
          f"final {dd['final']:.4f}, max after start {max(dd['curve'][1:]):.3f} vs start {dd['curve'][0]:.3f}, "
          f"{dd['rounds']} rounds, {dd['participants']:.2f} participants per round, {dd['wall_s']:.0f} s", flush=True)
    print(f"  curve {' '.join(f'{v:.3f}' for v in dd['curve'])}")
    m = dd["missed"]
    late = (f", published median / p90 / max {' / '.join(f'{v:+.3f}' for v in m['late_s'])} s after the close"
            if m["late_s"] else "")
    print(f"  updates that missed their round: {m['missed']} of {m['published']} "
          f"({m['missed'] / max(1, m['published']):.1%}){late}; learners waited {m['waits']} times, "
          f"{m['wait_s']:.2f} s in all", flush=True)

if __name__ == "__main__":
    main()
