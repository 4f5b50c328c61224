"""`ddiloco run --ray` against the local launcher: start-up, and kill -9 of a learner to contributing again.

    .venv/bin/python benchmarks/bench_ray.py [--repeats 1] [--kills 3] [--learners 2]

First Ray's own cost on this machine: `import ray`, `ray.init(num_cpus=2)` (a local instance), the memory
its processes hold (RSS, summed) and `ray.shutdown()`, each in a fresh interpreter. Then, side by side in one
run (local, Ray, local, Ray, ... `--repeats` times), the same tiny `ddiloco run` with each launcher:

- start-up: from starting `ddiloco run` to every learner training (its status.json says `training`), and
  to the first round committed;
- per kill -9 of a learner's process (learners in turn, each once it has contributed): to its new
  process's first line in the work ledger (`start`), and to that process's first update the syncer
  accepted (`fate: accepted`); times from the ledger's own `time` stamps.

Under the local launcher the supervisor restarts the learner after its 0.5 s backoff; under Ray the
learner's actor ends itself and Ray restarts the actor, which starts the process again. Run by hand;
figures go to docs/clusters.md.
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

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.02
WAIT_S = 300.0
TINY = ["--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1", "--model-context-len", "32",
        "--data-context-len", "32", "--data-batch-size", "4", "--num-fragments", "2", "--sync-every", "8",
        "--threads", "1", "--checkpoint-every-s", "1", "--no-evaluate"]
RAY_COST = r"""
import json, os, time
t0 = time.monotonic()
import ray
t1 = time.monotonic()
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
t2 = time.monotonic()
from ddiloco.runtime.ray_cluster import descendants
pids = descendants(os.getpid())
rss = 0
for pid in pids:
    try:
        rss += int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
t3 = time.monotonic()
ray.shutdown()
print(json.dumps({"version": ray.__version__, "import_s": t1 - t0, "init_s": t2 - t1,
                  "shutdown_s": time.monotonic() - t3, "processes": len(pids), "rss_mb": rss / 1e6}))
"""


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def ledger(run_dir: Path, learner_id: int) -> list[dict]:
    path = run_dir / "learners" / str(learner_id) / "work.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def wait(condition, what: str, popen: subprocess.Popen):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        if popen.poll() is not None:
            raise SystemExit(f"ddiloco run exited ({popen.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(POLL_S)
    return value


def ray_cost() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", RAY_COST], capture_output=True, text=True, env=env, timeout=WAIT_S,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def accepted_after_start(run_dir: Path, learner_id: int, since: float) -> tuple[float, float] | None:
    """(time of the first `start` after `since`, time of that process's first accepted update), once both exist."""
    start = None
    for line in ledger(run_dir, learner_id):
        if line["event"] == "start" and line["time"] > since and start is None:
            start = line["time"]
        elif start is not None and line["event"] == "fate" and line["fate"] == "accepted":
            return start, line["time"]
    return None


def measure(launcher: str, *, kills: int, learners: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-ray-{launcher}-")) / "run"
    flags = ["--ray"] if launcher == "ray" else []
    launched = time.time()
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", *flags, "--run-dir", str(run_dir),
                              "--no-progress", "--learners", str(learners), "--inner-steps", "100000000", *TINY],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    status = lambda i: read_json(run_dir / "learners" / str(i) / "status.json") or {}
    result: dict = {"launcher": launcher, "kills": []}
    try:
        wait(lambda: all(status(i).get("state") == "training" for i in range(learners)), "every learner", popen)
        result["to_training_s"] = time.time() - launched
        wait(lambda: (run_dir / "rounds.jsonl").exists() and (run_dir / "rounds.jsonl").stat().st_size > 0,
             "the first round", popen)
        result["to_first_round_s"] = time.time() - launched
        for kill in range(kills):
            victim_id = kill % learners
            wait(lambda v=victim_id: any(line["event"] == "fate" and line["fate"] == "accepted"
                                         for line in ledger(run_dir, v)[-50:]), "the victim to contribute", popen)
            victim = status(victim_id)["pid"]
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            start, accepted = wait(lambda v=victim_id, t=killed_at: accepted_after_start(run_dir, v, t),
                                   "the restarted learner's first accepted update", popen)
            result["kills"].append({"learner": victim_id, "to_start_s": start - killed_at,
                                    "to_accepted_s": accepted - killed_at})
    finally:
        stopped = time.monotonic()
        if popen.poll() is None:
            popen.send_signal(signal.SIGINT)
        try:
            popen.wait(timeout=WAIT_S)
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
        result["stop_s"] = time.monotonic() - stopped
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each launcher, alternating (default 1)")
    parser.add_argument("--kills", type=int, default=3, help="kill -9s of a learner per run (default 3)")
    parser.add_argument("--learners", type=int, default=2)
    args = parser.parse_args()

    cost = ray_cost()
    print(f"Ray {cost['version']} on this machine ({os.cpu_count()} cores): import {cost['import_s']:.2f} s, "
          f"ray.init(num_cpus=2) {cost['init_s']:.2f} s, {cost['processes']} processes holding "
          f"{cost['rss_mb']:.0f} MB RSS, ray.shutdown() {cost['shutdown_s']:.2f} s")
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    for _ in range(args.repeats):
        for launcher in ("local", "ray"):
            results[launcher].append(measure(launcher, kills=args.kills, learners=args.learners))
            print(json.dumps(results[launcher][-1]), flush=True)

    def median(launcher: str, key: str, per_kill: bool = False) -> float:
        runs = results[launcher]
        values = [k[key] for r in runs for k in r["kills"]] if per_kill else [r[key] for r in runs]
        return statistics.median(values)

    print(f"\n{'':38} {'local':>8} {'ray':>8} {'ray/local':>10}")
    for label, key, per_kill in (("start to every learner training", "to_training_s", False),
                                 ("start to the first round", "to_first_round_s", False),
                                 ("kill -9 to the new process", "to_start_s", True),
                                 ("kill -9 to its first accepted update", "to_accepted_s", True),
                                 ("Ctrl-C to everything stopped", "stop_s", False)):
        local, ray = median("local", key, per_kill), median("ray", key, per_kill)
        print(f"{label:38} {local:7.2f}s {ray:7.2f}s {ray / local:9.2f}x")
    print(f"(medians of {args.repeats} run(s) per launcher, {args.kills} kill(s) per run, {args.learners} learners)")


if __name__ == "__main__":
    main()
