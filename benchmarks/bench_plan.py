"""Planner benchmark (issue: planning at scale). Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_plan.py [--repeats 3]

Times the whole paper grid of `ddiloco plan goodput --paper-grid` (30 cells: data-parallel, elastic
data-parallel and Decoupled DiLoCo with M = 2, 4, 8, 16 at 150 k - 2.4 M chips; 5 replicas of 8 k
failures each) and prints the best wall time (target: under 10 s on two cores), the worst gap to the
paper's numbers (target: 4 points) and the bandwidth planner's time per call.
"""

from __future__ import annotations

import argparse
import time

from ddiloco.plan.bandwidth import BandwidthConfig, plan_bandwidth
from ddiloco.plan.paper_grid import PAPER_TOLERANCE_PCT, run_paper_grid

GRID_TARGET_S = 10.0
BANDWIDTH_CALLS = 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of the grid; the best time is reported")
    args = parser.parse_args()
    times, grid = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        grid = run_paper_grid()
        times.append(time.perf_counter() - start)
    assert grid is not None
    best = min(times)
    print(f"paper grid (30 cells): best {best:.2f} s of {args.repeats} (target < {GRID_TARGET_S:g} s) "
          f"{'OK' if best < GRID_TARGET_S else 'SLOW'}")
    print(f"worst gap to the paper: {grid.worst_gap_pct():.2f} points (tolerance {PAPER_TOLERANCE_PCT:g})")
    start = time.perf_counter()
    for _ in range(BANDWIDTH_CALLS):
        plan_bandwidth(BandwidthConfig())
    per_call_ms = (time.perf_counter() - start) / BANDWIDTH_CALLS * 1e3
    print(f"bandwidth planner: {per_call_ms:.3f} ms per call")


if __name__ == "__main__":
    main()
