"""The long soak: kill -9 learners and the syncer at random for a set time, then check every invariant.

    .venv/bin/python benchmarks/bench_soak.py [--duration 600] [--kill-every-s 10] [--learners 4] [--seed 0]

Runs `ddiloco chaos --soak --systems decoupled` (the runtime with warm restarts: standby learners and a
standby syncer) with the tiny integration-test model, so rounds come fast and the faults, not the training,
dominate. Prints: the time trained under the plan, the faults injected (and how many found a live process),
the rounds committed, the longest gap between commits (the watchdog fails the run past 60 s), syncer
take-overs and cold restarts, learner restarts, and each invariant. Run by hand; figures go to
docs/chaos.md. `tests/integration/test_chaos_run.py` runs a 60 s soak in CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1", "--model-context-len", "32",
        "--data-context-len", "32", "--data-batch-size", "4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--kill-every-s", type=float, default=10.0)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-soak-")) / "soak"
    started = time.monotonic()
    soak = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "chaos", "--soak", "--duration", str(args.duration),
                             "--kill-every-s", str(args.kill_every_s), "--plan-seed", str(args.seed), "--systems",
                             "decoupled", "--learners", str(args.learners), "--threads", "1", "--run-dir",
                             str(run_dir), "--json", *TINY], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert soak.stdout is not None
    lines = []
    for line in soak.stdout:  # its progress lines as they come (nothing showed for the 10 minutes); then its JSON
        lines.append(line.rstrip("\n"))
        if not line.startswith("{"):
            print(line, end="", flush=True)
    soak.wait()
    wall = time.monotonic() - started
    if not lines or not lines[-1].startswith("{"):
        raise SystemExit(f"ddiloco chaos printed no result (exit {soak.returncode}): its errors are above")
    result = json.loads(lines[-1])
    system = run_dir / "decoupled"
    faults = [json.loads(line) for line in (system / "chaos" / "faults.jsonl").read_text().splitlines()]
    record = json.loads((system / "chaos" / "run.json").read_text())
    events = [json.loads(line) for line in (system / "launcher" / "metrics.jsonl").read_text().splitlines()]
    rounds = (system / "rounds.jsonl").read_text().count("\n")
    restarts = Counter(e["name"] for e in events if e["event"] == "restart_scheduled")
    takeovers = sum(1 for e in events if e["event"] == "taken_over")
    kinds = Counter(f["kind"] for f in faults if f["started"] is not None)
    live = sum(1 for f in faults if f["started"] is not None and f["pids"])
    print(f"soak: {args.duration:g} s under the plan ({wall:.0f} s wall with start-up and analysis), "
          f"{args.learners} learners, a kill every {args.kill_every_s:g} s on average, seed {args.seed}")
    print(f"faults injected: {sum(kinds.values())} ({dict(kinds)}), {live} on a live process")
    print(f"rounds committed: {rounds}; longest gap between commits: {record['longest_commit_gap_s']:.1f} s "
          f"(watchdog 60 s); failure: {record['failure']}")
    print(f"syncer: {takeovers} take-overs by the standby, {restarts.get('syncer', 0)} cold restarts; learner "
          f"restarts: {sum(n for name, n in restarts.items() if name.startswith('learner'))}")
    for name, ok in result["invariants"].items():
        print(f"invariant {name}: {'holds' if ok else 'BROKEN'}")
    print(f"exit status of ddiloco chaos: {soak.returncode}; run directory {run_dir}")


if __name__ == "__main__":
    main()
