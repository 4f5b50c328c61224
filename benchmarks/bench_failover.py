"""kill -9 of the syncer to the first round committed after it: a standby syncer against a cold restart.

    .venv/bin/python benchmarks/bench_failover.py [--kills 3] [--learners 2] [--model-width 128]

Two `ddiloco run`s on this machine, one after the other, with the same model and learners: one with
`--standby-syncer` (the standby follows the syncer's round log and takes over on the same address), one
without (the supervisor restarts the syncer cold after its backoff: a new interpreter imports torch, loads
the state, replays the rounds since it). In each, the syncer is killed with SIGKILL `--kills` times, each
time once the run has committed rounds again (and, with the standby, once the new standby follows). Per
kill it prints: kill to a new syncer serving (syncer.json names a new pid), kill to the first round that
syncer commits (the time of its first `commit` event), and the inner steps each learner trained in between
(a learner that stopped training would show 0). Run by hand; figures go to docs/runtime.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddiloco.checkpoint import read_jsonl

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.01
WAIT_S = 180.0


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait(condition, what: str, popen: subprocess.Popen):
    deadline = time.monotonic() + WAIT_S
    while True:
        value = condition()
        if value:
            return value
        if popen.poll() is not None:
            raise SystemExit(f"ddiloco run exited ({popen.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def rounds(run_dir: Path) -> int:
    path = run_dir / "rounds.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def first_commit_after(run_dir: Path, t0: float) -> float | None:
    """Wall time of the first commit event after t0 in the syncer's metrics."""
    path = run_dir / "syncer" / "metrics.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "commit" and record["time"] > t0:
            return record["time"]
    return None


def steps_between(run_dir: Path, learners: int, start: float, end: float) -> list[int]:
    """Inner steps each learner finished from `start` to `end` (wall time), from its step lines in its metrics: its
    status.json, rewritten once a second, read 0 steps in a window shorter than that."""
    counts = []
    for i in range(learners):
        key = f"learner/{i}/tokens"  # logged at every inner step
        lines = read_jsonl(run_dir / "learners" / str(i) / "metrics.jsonl")
        counts.append(sum(1 for line in lines if key in line and start <= line.get("time", -1.0) <= end))
    return counts


def standby_follows(run_dir: Path, count: int) -> bool:
    log = run_dir / "logs" / "syncer-standby.log"
    return log.exists() and log.read_text().count("standby: at round") >= count


def measure(standby: bool, *, kills: int, learners: int, width: int) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-failover-")) / "run"
    flags = ["--learners", str(learners), "--inner-steps", "100000000", "--model-width", str(width),
             "--model-num-layers", "2", "--model-num-heads", "4", "--num-fragments", "2", "--sync-every", "8",
             "--threads", "1", "--max-wait-s", "0.5", "--no-progress", "--no-evaluate"]
    if standby:
        flags.append("--standby-syncer")
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *flags],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    results = []
    try:
        for kill in range(kills):
            base = rounds(run_dir)
            wait(lambda base=base: rounds(run_dir) >= base + 20, "20 rounds", popen)
            if standby:
                wait(lambda kill=kill: standby_follows(run_dir, kill + 1), "the standby following", popen)
            victim = read_json(run_dir / "syncer.json")["pid"]
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)
            wait(lambda victim=victim: (read_json(run_dir / "syncer.json") or {}).get("pid") not in (None, victim),
                 "a new syncer", popen)
            serving = time.time() - t0
            committed = wait(lambda t0=t0: first_commit_after(run_dir, t0), "its first round", popen)
            results.append({"serving_s": serving, "first_round_s": committed - t0,
                            "steps": steps_between(run_dir, learners, t0, committed)})
            print(f"  {'standby' if standby else 'cold'} kill {kill + 1}: serving after {serving:.2f} s, first round "
                  f"after {committed - t0:.2f} s, learner steps meanwhile {results[-1]['steps']}", flush=True)
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGINT)
            try:
                popen.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--model-width", type=int, default=128)
    args = parser.parse_args()
    table = {}
    for standby in (True, False):
        table["standby" if standby else "cold restart"] = measure(standby, kills=args.kills, learners=args.learners,
                                                                   width=args.model_width)
    print(f"\nkill -9 of the syncer, {args.learners} learners, model width {args.model_width}, "
          f"{os.cpu_count()} cores (median of {args.kills} kills):")
    print(f"{'':>14} {'serving (s)':>12} {'first round (s)':>16} {'fewest learner steps meanwhile':>31}")
    for name, results in table.items():
        print(f"{name:>14} {statistics.median(r['serving_s'] for r in results):>12.2f} "
              f"{statistics.median(r['first_round_s'] for r in results):>16.2f} "
              f"{min(min(r['steps']) for r in results):>31}")


if __name__ == "__main__":
    main()
