"""What reading a long run's round log costs each of its readers: a syncer's start, a standby's first look and the
end-of-run summary.

`rounds.jsonl` holds a line per committed round (its participants, times and checksum): at the paper's scale for one
syncer (P = 24, a fragment every inner step of about 1 s) a month is 2.6 million rounds, gigabytes of text. This
writes a synthetic log of N rounds of M learners in the syncer's own format and, each in a fresh process, times one
reader's pass over it with that process's peak memory (`ru_maxrss`) against the same process before the pass (imports
done): the syncer's start (`SyncerStore.participation`, the per-learner counts its restore takes from every line, and
`RoundLog.repair`), a standby's first look (`LogFollower.new_records`) and the summary (`report.round_totals`). The
replay of the rounds after the newest full state, which loads their tensors files, is not part of it.

    .venv/bin/python benchmarks/bench_round_log.py --rounds 200000 --learners 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

FRAGMENTS = 4


def write_log(root: Path, rounds: int, learners: int) -> int:
    """`rounds` lines of `learners` participants each; returns the log's size in bytes."""
    participant = {"base_version": 0, "folded": [], "inner_step": 4, "staleness": 0, "steps": 4, "tokens": 8192,
                   "weight": 16777216.0}
    with (root / "rounds.jsonl").open("w") as log:
        for index in range(rounds):
            log.write(json.dumps({
                "round": index, "fragment": index % FRAGMENTS, "version": index // FRAGMENTS + 1,
                "opened_at": 1.0, "quorum_at": 1.1, "closed_at": 1.7, "grace_s": 0.6, "rejections": [],
                "summed": list(range(learners)), "tensors_checksum": "crc32:aad99e69",
                "participants": [{**participant, "learner_id": i} for i in range(learners)]}, sort_keys=True) + "\n")
    return (root / "rounds.jsonl").stat().st_size


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _measure(root: str, reader: str, queue) -> None:
    from ddiloco.runtime.report import round_totals
    from ddiloco.runtime.run_paths import RunPaths
    from ddiloco.runtime.syncer_standby import LogFollower
    from ddiloco.runtime.syncer_state import SyncerStore

    store = SyncerStore(root)
    passes = {"syncer start": lambda: (store.participation([1 / FRAGMENTS] * FRAGMENTS), store.log.repair()),
              "standby's first look": lambda: LogFollower(store.log).new_records(after=1 << 62),
              "summary": lambda: round_totals(RunPaths(Path(root)))}
    before = _peak_mb()
    start = time.perf_counter()
    passes[reader]()
    queue.put((time.perf_counter() - start, _peak_mb() - before))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200_000)
    parser.add_argument("--learners", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        size = write_log(Path(tmp), args.rounds, args.learners)
        print(f"round log: {args.rounds:,} rounds of {args.learners} learners, {size / 1e6:.0f} MB", flush=True)
        context = multiprocessing.get_context("spawn")
        for reader in ("syncer start", "standby's first look", "summary"):
            queue = context.Queue()
            child = context.Process(target=_measure, args=(tmp, reader, queue))
            child.start()
            seconds, peak_mb = queue.get()
            child.join()
            print(f"{reader}: {seconds:.1f} s, peak memory +{peak_mb:.0f} MB over the process before it", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
