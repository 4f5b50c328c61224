"""`ddiloco experiment NAME`: run one of the harness's named experiments and write its run directory.

    ddiloco experiment quality                 # full size (minutes), table + plots in runs/...
    ddiloco experiment failures --quick --json # small version (seconds); JSON as the last stdout line

Progress goes to stderr, the results table to stdout, and with `--json` one JSON object
(`{"experiment": NAME, "systems": {SYSTEM: {"goodput": ..., "uptime": ..., "final_val_loss": ...}}, ...}`)
is the last line of stdout, for scripts and CI. The experiments are described in
`ddiloco.sim.experiments` and their full-size results in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddiloco.sim.experiments import EXPERIMENTS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "experiment", help="run a named experiment in the virtual-time harness",
        description="Run a named experiment (Decoupled DiLoCo vs baselines) in the virtual-time harness and "
                    "write a results table, JSON and PNG plots into a run directory.")
    parser.add_argument("name", choices=list(EXPERIMENTS), help="which experiment")
    parser.add_argument("--quick", action="store_true", help="a small version that runs in seconds")
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON object on the last line of stdout")
    parser.add_argument("--out", type=Path, default=None,
                        help="run directory (default: runs/experiment-NAME-<timestamp>)")
    parser.add_argument("--seed", type=int, default=0, help="seed of models, jitter and failures (default: 0)")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from ddiloco.run_config import MAX_SEED
    from ddiloco.runtime.run_dir import new_output_dir
    from ddiloco.sim.experiments import run_experiment
    from ddiloco.sim.report import rich_table, write_run
    from ddiloco.stdout_pipe import PipeConsole

    # One thread: the harness is deterministic per thread count, and the machine is shared (docs/architecture.md).
    torch.set_num_threads(1)
    # The generators take 64-bit seeds: a larger one fails deep inside the first system's run.
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed {args.seed} is invalid: expected an integer in 0..{MAX_SEED} (2**63 - 1)")
    # Before the experiment, which takes minutes: a file, /dev/null, a read-only folder or one holding another
    # run's files (which this one's would mix with) is one line now.
    out_dir = new_output_dir(args.out, f"experiment-{args.name}", flag="--out")
    # soft_wrap: off a terminal Rich assumes 80 columns and would cut a progress line in two (in a log, a pipe).
    errors = Console(stderr=True, soft_wrap=True)
    result = run_experiment(args.name, quick=args.quick, seed=args.seed,
                            progress=lambda line: errors.print(line, markup=False, highlight=False))
    command = f"ddiloco experiment {args.name}" + (" --quick" if args.quick else "") + (
        f" --seed {args.seed}" if args.seed else "")
    write_run(result, out_dir, command=command)
    console = PipeConsole(file=sys.stdout, width=200)  # goes quiet if stdout closes: the results are written
    console.print(rich_table(result))
    for check in result.checks:
        verdict = "PASS" if check.passed else "MISS"
        console.print(f"{verdict}  {check.name}: {check.measured}", markup=False, highlight=False)
    console.print(f"wrote {out_dir} ({result.wall_s:.1f} s)", markup=False, highlight=False)
    if args.json:
        sys.stdout.flush()
        print(json.dumps(result.to_json(), default=str), flush=True)
    return 0
