"""kill -9 of the syncer in the middle of a run, or a freeze of it: how much of what each learner trained reached the
global model.

    .venv/bin/python benchmarks/bench_kill_tokens.py [--runs 2] [--learners 3] [--inner-steps 200] [--kill-at 80]
    .venv/bin/python benchmarks/bench_kill_tokens.py --freeze 40 --tiny --inner-steps 6000 --kill-at 1000
    .venv/bin/python benchmarks/bench_kill_tokens.py --src /path/to/other/checkout/src   # the same against another

Each run is a `ddiloco run` of the built-in TinyGPT (`--tiny`: one of about 20 k parameters, whose steps take
milliseconds); once every learner has passed inner step `--kill-at` (their status.json), the syncer is SIGKILLed once
and the launcher restarts it, or, with `--freeze S`, it is stopped (SIGSTOP) for S seconds and continued (a suspended
VM, a long swap storm). Meanwhile the learners train on, their updates undelivered or refused as `unknown_learner`,
and each re-joins with a Welcome that may bring a fragment moved on by another learner's rounds, by several versions
where the first learner back publishes its work of the outage before the others join again. Per run it prints each
learner's `tokens_merged` of its `tokens` (summary.json) and the share over all learners; work lost in the outage
shows as a share below 1. Run by hand; figures go to the session's note and docs/runtime.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY_MODEL_FLAGS = ("--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1",
                    "--model-context-len", "32", "--data-context-len", "32", "--data-batch-size", "4")


def status_steps(run_dir: Path, learners: int) -> list[int] | None:
    try:
        return [json.loads((run_dir / "learners" / str(i) / "status.json").read_text())["inner_step"]
                for i in range(learners)]
    except (OSError, ValueError, KeyError):
        return None


def one_run(run_dir: Path, args: argparse.Namespace) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.src:
        env["PYTHONPATH"] = args.src
    command = [sys.executable, "-m", "ddiloco", "run", "--run-dir", str(run_dir), "--learners", str(args.learners),
               "--inner-steps", str(args.inner_steps), "--threads", "1", "--no-progress", "--json"]
    if args.tiny:
        command += ["--no-evaluate", *TINY_MODEL_FLAGS]
    run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_at = None
    try:
        while run.poll() is None and killed_at is None:
            time.sleep(0.2)
            steps = status_steps(run_dir, args.learners)
            if steps is not None and min(steps) >= args.kill_at:
                pid = json.loads((run_dir / "syncer.json").read_text())["pid"]
                killed_at = steps
                if not args.freeze:
                    os.kill(pid, signal.SIGKILL)
                    continue
                os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(args.freeze)
                finally:
                    os.kill(pid, signal.SIGCONT)
        run.wait(timeout=args.timeout_s)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=60)
    summary = json.loads((run_dir / "summary.json").read_text())
    learners = summary["learners"]
    merged = sum(v["tokens_merged"] for v in learners.values())
    trained = sum(v["tokens"] for v in learners.values())
    print(f"{run_dir.name}: syncer {f'frozen {args.freeze:g} s' if args.freeze else 'killed'} at inner steps "
          f"{killed_at}; {summary['outcome']}, "
          f"{summary['rounds_committed']} rounds")
    for learner_id, v in sorted(learners.items()):
        print(f"  learner {learner_id}: tokens_merged {v['tokens_merged']:,} of {v['tokens']:,}, joins {v['joins']}")
    print(f"  all learners: {merged:,} of {trained:,} = {merged / trained:.4f}")
    return merged / trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=80, help="kill once every learner passed this inner step")
    parser.add_argument("--freeze", type=float, default=0.0, help="stop the syncer this long instead of killing it")
    parser.add_argument("--tiny", action="store_true", help="a TinyGPT of about 20 k parameters, no evaluator")
    parser.add_argument("--src", default="", help="another checkout's src/ to run instead of this one")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--keep", default="", help="a new folder to keep the run directories in")
    args = parser.parse_args()
    if args.keep:  # the run directories stay, for their work.jsonl and logs
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        shares = [one_run(Path(args.keep) / f"run{n}", args) for n in range(args.runs)]
    else:
        with tempfile.TemporaryDirectory(prefix="bench_kill_tokens_") as tmp:
            shares = [one_run(Path(tmp) / f"run{n}", args) for n in range(args.runs)]
    print("shares merged:", " ".join(f"{share:.4f}" for share in shares))


if __name__ == "__main__":
    main()
