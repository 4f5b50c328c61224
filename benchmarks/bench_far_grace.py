"""One learner near the syncer, one far from it: what the adaptive grace window costs the near one. Run by hand.

    .venv/bin/python benchmarks/bench_far_grace.py                      # 300 ms each way, adaptive and none (~1 min)
    .venv/bin/python benchmarks/bench_far_grace.py --latency-ms 100 --inner-steps 400

A real syncer and two real learners (`ddiloco syncer`, `ddiloco learner`, a small TinyGPT, one torch thread each):
learner 0 talks to the syncer over 127.0.0.1 as it is, learner 1 through an emulated link (`--link`, the learner's
own traffic shaping) of `--latency-ms` each way. Each case is one run to `--inner-steps`, with `--grace adaptive`
(the default) and `--grace none`. Printed per case: the syncer's step time, sync time, path time and last grace
window (`syncer_status.json`), the learners' own compute time per step (`learner/N/step_s`), how often and how long
the near learner waited for a result (`learner/0/wait_s`), rounds committed and the wall time.

Until 2026-12-07 the syncer's step time was the spacing of the learners' updates, which the far learner's waits
stretch, its sync time left the link out, and the window sat at its cap. `PYTHONPATH=<an older checkout>/src` runs
this against that code (docs/clusters.md, "Links with a long round trip", has both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ("--model-width", "64", "--model-num-heads", "2", "--model-num-layers", "2", "--model-context-len", "64",
         "--data-context-len", "64", "--data-batch-size", "4", "--num-fragments", "2", "--sync-every", "16")


def _start(log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", *args], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_case(root: Path, *, grace: str, latency_ms: int, inner_steps: int, timeout_s: float) -> dict:
    run_dir = root / f"run-{grace}"
    syncer = _start(root / f"syncer-{grace}.log", "syncer", "--bind", "127.0.0.1:0", "--run-dir", str(run_dir),
                    "--learners", "2", "--allow-no-token", "--grace", grace, *MODEL)
    learners: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 60
        while (info := _read_json(run_dir / "syncer.json")) is None:
            if syncer.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the syncer did not start: see {root / f'syncer-{grace}.log'}")
            time.sleep(0.2)
        started = time.monotonic()
        for learner_id, link in ((0, ()), (1, ("--link", f"10gbit,{latency_ms}ms"))):
            learners.append(_start(root / f"learner{learner_id}-{grace}.log", "learner", "--syncer", info["address"],
                                   "--learner-id", str(learner_id), "--run-dir", str(run_dir), "--threads", "1",
                                   "--inner-steps", str(inner_steps), *link, *MODEL))
        for popen in learners:
            popen.wait(timeout=timeout_s)
        wall_s = time.monotonic() - started
        time.sleep(2.5)  # the syncer's status is rewritten every second
        status = _read_json(run_dir / "syncer_status.json") or {}
    finally:
        for popen in (*learners, syncer):
            if popen.poll() is None:
                popen.terminate()
                popen.wait(timeout=30)
    metrics = [json.loads(line) for path in run_dir.rglob("metrics.jsonl") for line in path.open()]

    def series(name: str) -> list[float]:
        return [m[name] for m in metrics if name in m]

    waits = series("learner/0/wait_s")
    return {"grace": grace, "exit": [p.returncode for p in learners], "wall_s": wall_s,
            "step_time_s": status.get("step_time_s"), "grace_s": status.get("grace_s"),
            "path_time_s": status.get("path_time_s"), "sync_time_s": status.get("sync_time_s"),
            "rounds": status.get("rounds_committed"),
            "compute_s": [statistics.fmean(series(f"learner/{i}/step_s")) for i in (0, 1)],
            "near_waits": sum(1 for w in waits if w > 0), "near_wait_s": sum(waits),
            "near_compute_s": sum(series("learner/0/step_s"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-ms", type=int, default=300, help="the far learner's one-way latency")
    parser.add_argument("--inner-steps", type=int, default=300)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories and logs in DIR (new or empty)")
    parser.add_argument("--grace", nargs="+", default=["adaptive", "none"], choices=["adaptive", "none"])
    args = parser.parse_args()
    import ddiloco

    print(f"ddiloco from {Path(ddiloco.__file__).parent}; far learner {args.latency_ms} ms each way, "
          f"{args.inner_steps} inner steps")
    with contextlib.ExitStack() as stack:
        root = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_far_grace_"))
        Path(root).mkdir(parents=True, exist_ok=True)
        for grace in args.grace:
            r = run_case(Path(root), grace=grace, latency_ms=args.latency_ms, inner_steps=args.inner_steps,
                         timeout_s=args.timeout_s)
            print(f"grace {r['grace']:8s} exit {r['exit']}  syncer step time {_ms(r['step_time_s'])}, sync time "
                  f"{_ms(r['sync_time_s'])}, path time {_ms(r.get('path_time_s'))}, last window "
                  f"{_ms(r['grace_s'])}; learners' compute {_ms(r['compute_s'][0])} and {_ms(r['compute_s'][1])} "
                  f"per step; near learner waited {r['near_waits']} times, {r['near_wait_s']:.2f} s (its compute "
                  f"{r['near_compute_s']:.2f} s); {r['rounds']} rounds in {r['wall_s']:.1f} s", flush=True)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"


if __name__ == "__main__":
    main()
