"""How long a healthy learner goes between its accepted updates: the figures behind `--progress-timeout-s`
(`QuorumConfig.progress_timeout_s`) and `liveness.STALL_PERIODS`. Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_update_gaps.py runs/*            # real runs: their metrics.jsonl
    .venv/bin/python benchmarks/bench_update_gaps.py --harness failures heterogeneous   # harness experiments

1. Real runs: for each run directory, from the syncer's `update` and `join` events in metrics.jsonl, the longest time
   between two accepted updates of one learner and from a learner's join to its first accepted update.
2. `--harness NAME...`: the named `ddiloco experiment`s at full scale, with the syncer core's progress events timed
   (each gap in seconds of virtual time and in sync periods, sync_every x the run's step time, where one is estimated).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path


def real_run_gaps(run: Path) -> tuple[int, float, float, int] | None:
    """(K, longest gap between a learner's accepted updates, longest join-to-first-update, updates) of `run`; None
    where it has no readable config or metrics."""
    try:
        config = json.loads((run / "config.json").read_text())
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError):
        return None
    last: dict[int, tuple[str, float]] = {}
    gaps: dict[str, list[float]] = defaultdict(list)
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("source") != "syncer":
            continue
        learner = event.get("learner_id")
        if event.get("event") == "join":
            last[learner] = ("join", event["time"])
        elif event.get("event") == "update" and event.get("accepted"):
            if learner in last:
                kind, at = last[learner]
                gaps[kind].append(event["time"] - at)
            last[learner] = ("update", event["time"])
    return (config["quorum"]["min_quorum"], max(gaps["update"], default=0.0), max(gaps["join"], default=0.0),
            len(gaps["update"]))


def harness_gaps(name: str) -> tuple[float, float]:
    """(longest gap in seconds, longest in sync periods) between a learner's progress events in the harness's
    experiment `name` (full scale)."""
    from ddiloco import syncer as syncer_module
    from ddiloco.cli import main

    seconds, periods = [0.0], [0.0]
    on_update = syncer_module.Syncer._on_update

    def timed(self, update, now):  # instrumentation of this benchmark only
        info = self.learners.get(update.learner_id)
        before = None if info is None else info.last_progress
        actions = on_update(self, update, now)
        if info is not None and info.last_progress != before:  # it counted as progress
            gap = now - before
            seconds.append(gap)
            if self.step_time.value:
                periods.append(gap / (self.config.sync_every * self.step_time.value))
        return actions

    syncer_module.Syncer._on_update = timed
    try:
        with tempfile.TemporaryDirectory() as out:
            try:
                main(["experiment", name, "--out", str(Path(out) / name)])
            except SystemExit as exc:
                if exc.code:
                    raise
    finally:
        syncer_module.Syncer._on_update = on_update
    return max(seconds), max(periods)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories")
    parser.add_argument("--harness", nargs="*", default=[], help="ddiloco experiment names")
    args = parser.parse_args()
    rows = [(run, gaps) for run in args.runs if (gaps := real_run_gaps(run)) is not None]
    if rows:
        print(f"{'run':60} {'K':>3} {'max gap s':>10} {'join->first s':>14} {'updates':>8}")
        for run, (k, gap, first, updates) in sorted(rows, key=lambda row: -row[1][1]):
            print(f"{str(run)[-60:]:60} {k:>3} {gap:>10.1f} {first:>14.1f} {updates:>8}")
        print(f"{len(rows)} runs: longest gap {max(g[1] for _, g in rows):.1f} s, "
              f"longest join->first update {max(g[2] for _, g in rows):.1f} s")
    for name in args.harness:
        seconds, periods = harness_gaps(name)
        print(f"harness {name}: longest gap {seconds:.1f} s (virtual), {periods:.2f} sync periods")


if __name__ == "__main__":
    main()
