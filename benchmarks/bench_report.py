"""What the end-of-run report costs on a long run: merged metrics, summary.json and the plots.

`ddiloco run` ends (and so does each `--resume` session) by rewriting `metrics.jsonl` from every process's metrics,
building `summary.json` and drawing three PNGs (`ddiloco.runtime.report.write_report`). Each learner writes a line
per inner step, so a long run has millions of lines. This writes a synthetic run directory of that size (M learners
x N step lines, a syncer line per round, an evaluation every 50 rounds, a round log and work ledgers, in the formats
the processes write) and times each part of the report in a fresh process, with the process's peak memory (its
`ru_maxrss`) against the same process before the report (imports done).

    .venv/bin/python benchmarks/bench_report.py --learners 2 --steps 500000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import tempfile
import time
from pathlib import Path

SYNC_EVERY = 16
EVAL_EVERY_ROUNDS = 50
T0 = 1_800_000_000.0


def write_run(root: Path, learners: int, steps: int) -> int:
    """A run directory of `learners` x `steps` learner step lines; returns the lines written."""
    rng = random.Random(0)
    lines = 0
    for learner in range(learners):
        directory = root / "learners" / str(learner)
        directory.mkdir(parents=True)
        with (directory / "metrics.jsonl").open("w") as metrics, (directory / "work.jsonl").open("w") as work:
            work.write(json.dumps({"event": "start", "time": T0, "pid": 1, "inner_step": 0}) + "\n")
            for step in range(1, steps + 1):
                metrics.write(json.dumps({"step": step, "time": T0 + step * 0.5 + learner * 0.01,
                                          f"learner/{learner}/tokens": 64 * step,
                                          f"learner/{learner}/step_s": 0.05 + rng.random() * 0.01,
                                          f"learner/{learner}/loss": 5.0 / (1 + step / 1000) + rng.random()}) + "\n")
                if step % SYNC_EVERY == 0:
                    work.write(json.dumps({"event": "publish", "time": T0 + step * 0.5, "fragment": 0,
                                           "base_version": step // SYNC_EVERY, "inner_step": step, "steps": 16,
                                           "new_steps": 16, "tokens": 1024}) + "\n")
            lines += steps
        (directory / "status.json").write_text(json.dumps({"state": "done", "inner_step": steps,
                                                           "inner_steps": steps, "tokens": 64 * steps}))
    rounds = steps // SYNC_EVERY
    (root / "syncer").mkdir()
    (root / "evaluator").mkdir()
    (root / "launcher").mkdir()
    with (root / "syncer" / "metrics.jsonl").open("w") as syncer, (root / "rounds.jsonl").open("w") as log, \
            (root / "evaluator" / "metrics.jsonl").open("w") as evaluator:
        for index in range(rounds):
            time_s = T0 + (index + 1) * SYNC_EVERY * 0.5
            syncer.write(json.dumps({"step": index + 1, "time": time_s, "syncer/rounds_committed": index + 1,
                                     "syncer/participants": learners, "syncer/grace_s": 0.1}) + "\n")
            log.write(json.dumps({"round": index, "fragment": 0, "version": index + 1, "participants": [
                {"learner_id": learner, "staleness": 0, "tokens": 1024} for learner in range(learners)]}) + "\n")
            if index % EVAL_EVERY_ROUNDS == 0:
                evaluator.write(json.dumps({"step": index, "time": time_s, "eval/val_loss": 3.0 / (1 + index / 100),
                                            "eval/rounds_committed": index}) + "\n")
        lines += rounds + rounds // EVAL_EVERY_ROUNDS
    (root / "launcher" / "metrics.jsonl").write_text(json.dumps({"event": "run_started", "time": T0}) + "\n")
    return lines


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _measure(root: str, learners: int, queue) -> None:
    from ddiloco.runtime import report, report_plots
    from ddiloco.runtime.run_paths import RunPaths
    report_plots._pyplot()  # matplotlib's import is not the report's work
    paths, figures = RunPaths(Path(root)), {}
    before = _peak_mb()
    start = time.perf_counter()
    report.merge_metrics(paths)
    figures["merge_metrics"] = time.perf_counter() - start
    start = time.perf_counter()
    summary = report.build_summary(paths, num_learners=learners, outcome="completed", wall_time_s=1.0)
    figures["build_summary"] = time.perf_counter() - start
    start = time.perf_counter()
    report_plots.write_plots(paths, summary)
    figures["write_plots"] = time.perf_counter() - start
    figures["peak_mb"] = _peak_mb() - before
    queue.put(figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500_000, help="step lines per learner")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        lines = write_run(Path(tmp), args.learners, args.steps)
        size_mb = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()) / 1e6
        written_s = time.perf_counter() - start
        print(f"run directory: {lines:,} metric lines, {size_mb:.0f} MB, written in {written_s:.1f} s", flush=True)
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_measure, args=(tmp, args.learners, queue))
        child.start()
        figures = queue.get()
        child.join()
    print(f"merge_metrics {figures['merge_metrics']:.2f} s, build_summary {figures['build_summary']:.2f} s, "
          f"write_plots {figures['write_plots']:.2f} s, total "
          f"{figures['merge_metrics'] + figures['build_summary'] + figures['write_plots']:.2f} s; "
          f"peak memory +{figures['peak_mb']:.0f} MB over the process before the report")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
