"""`ddiloco plan goodput` and `ddiloco plan bandwidth`: the planners on the command line.

Registers the `plan` subcommand on the parser that `ddiloco.cli` passes in (`add_parser`) and runs it
(`run`). Flags map one-to-one onto the fields of the planners' config dataclasses through
`ddiloco.flags`; a bad value ends with one line on stderr that names the flag, and exit code 2.
`--json` prints one JSON object as the last line of stdout; plots go to `--out` as PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from ddiloco.exit_status import EXIT_USAGE
from ddiloco.flags import add_config_flags, config_from_args
from ddiloco.plan.bandwidth import BandwidthConfig, plan_bandwidth
from ddiloco.plan.failures import FailureModel
from ddiloco.plan.goodput import SYSTEMS, horizon_for, simulate
from ddiloco.plan.paper_grid import grid_simulation, run_paper_grid
from ddiloco.plan.scenario import LayoutConfig, ReconfigurationCosts, ScavengeConfig, Scenario, SimulationConfig

SCAVENGE_PREFIX = "scavenge_"

GOODPUT_CONFIGS = (
    (LayoutConfig, "", "layout"),
    (FailureModel, "", "failures and recovery (calibrated defaults, docs/planning.md)"),
    (ReconfigurationCosts, "", "cost of a change of hardware (calibrated defaults)"),
    (ScavengeConfig, SCAVENGE_PREFIX, "scavenging: extra learners that come and go"),
    (SimulationConfig, "", "simulation"),
)
BANDWIDTH_CONFIGS = ((BandwidthConfig, "", "layout"),)


def _plot_dir(args: argparse.Namespace) -> Path:
    """Where the plots go, checked (made, written to) before any simulation, as `ddiloco run` checks its run
    directory: a file there is one line now, not a traceback after the work. --no-plot writes nothing, and makes
    nothing (the path it returns then is not used)."""
    from ddiloco.runtime.run_dir import fresh_dir, prepare_run_dir

    if args.no_plot:
        return args.out or Path()
    if args.out is None:  # a name no other command has, however many start in this second
        return fresh_dir("plan", flag="--out")[0]
    prepare_run_dir(args.out, flag="--out")
    return args.out


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    group.add_argument("--out", type=Path, default=None,
                       help="folder for PNG plots (default: runs/plan-<timestamp>)")
    group.add_argument("--no-plot", action="store_true", help="skip the PNG plots")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` with its planners `goodput` and `bandwidth` on `subparsers`."""
    plan = subparsers.add_parser(
        "plan", help="plan a run before renting hardware: goodput at scale, link bandwidth",
        description="Answer layout questions in seconds: how many learners, what quorum, which links.")
    planners = plan.add_subparsers(dest="plan_command", required=True, metavar="PLANNER")
    goodput = planners.add_parser(
        "goodput", help="simulated goodput and uptime of data-parallel, elastic DP and Decoupled DiLoCo",
        description="Simulate failures on 10 k to millions of chips (Poisson interruptions, exponentiated "
                    "Weibull recovery) and report goodput, uptime and tokens per hour with 95 % intervals.")
    for cls, prefix, title in GOODPUT_CONFIGS:
        add_config_flags(goodput, cls, prefix=prefix, title=title)
    extra = goodput.add_argument_group("what to simulate")
    extra.add_argument("--systems", default=",".join(SYSTEMS),
                       help=f"comma-separated systems among {', '.join(SYSTEMS)} (default: all)")
    extra.add_argument("--sweep-chips", default="",
                       help="comma-separated chip counts to simulate instead of --chips (plots goodput vs. chips)")
    extra.add_argument("--paper-grid", action="store_true",
                       help="simulate the paper's grid (150 k - 2.4 M chips, DP, elastic DP, M = 2, 4, 8, 16) "
                            "and print it beside the paper's numbers")
    _add_output_flags(goodput)
    bandwidth = planners.add_parser(
        "bandwidth", help="link bandwidth for Decoupled DiLoCo, synchronous DiLoCo and data-parallel",
        description="Average and required bandwidth of every learner link, region WAN link and the syncer, "
                    "with every assumption printed.")
    for cls, prefix, title in BANDWIDTH_CONFIGS:
        add_config_flags(bandwidth, cls, prefix=prefix, title=title)
    _add_output_flags(bandwidth)


def _flag_names(configs: tuple) -> dict[str, str]:
    names = {}
    for cls, prefix, _ in configs:
        for f in dataclasses.fields(cls):
            names[f.name] = "--" + (prefix + f.name).replace("_", "-")
    return names


def _usage_error(args: argparse.Namespace, message: str) -> int:
    print(f"ddiloco plan {args.plan_command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _as_flag(exc: ValueError, configs: tuple) -> str:
    """'chips=0 is invalid: ...' -> '--chips=0 is invalid: ...' (config errors name fields)."""
    message = str(exc)
    field, sep, rest = message.partition("=")
    flag = _flag_names(configs).get(field)
    return f"{flag}={rest}" if sep and flag else message


def _int_list(flag: str, text: str) -> list[int]:
    try:
        numbers = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} is invalid: expected comma-separated chip counts, "
                         "e.g. 150000,1.2e6") from None
    if not all(math.isfinite(number) and number == int(number) for number in numbers):
        raise ValueError(f"{flag}={text!r} is invalid: expected whole chip counts, e.g. 150000,1.2e6")
    values = [int(number) for number in numbers]
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} is invalid: expected chip counts >= 1")
    return values


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if not names or unknown:
        raise ValueError(f"--systems={text!r} is invalid: expected a comma-separated subset of {', '.join(SYSTEMS)}")
    return names


def _scenario(args: argparse.Namespace, chips: int | None = None) -> Scenario:
    layout = config_from_args(LayoutConfig, args)
    if chips is not None:
        layout = dataclasses.replace(layout, chips=chips)
    return Scenario(layout=layout, failures=config_from_args(FailureModel, args),
                    costs=config_from_args(ReconfigurationCosts, args),
                    scavenge=config_from_args(ScavengeConfig, args, prefix=SCAVENGE_PREFIX))


def run(args: argparse.Namespace) -> int:
    """Run `ddiloco plan goodput` or `ddiloco plan bandwidth`; the exit code. NumPy's overflow warnings are off: a
    result that is not finite is refused in one line instead (`_out_of_range`)."""
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if args.plan_command == "goodput":
            return _run_goodput(args)
        if args.plan_command == "bandwidth":
            return _run_bandwidth(args)
    return _usage_error(args, f"unknown planner {args.plan_command!r}: expected goodput or bandwidth")


def _print_json(obj: dict) -> None:
    sys.stdout.flush()
    print(json.dumps(obj, sort_keys=False, allow_nan=False))  # results are checked finite first (`_non_finite`)


def _non_finite(obj: object, path: str = "") -> tuple[str, float] | None:
    """The first number in `obj` (a result's dict) that is not finite, with where it is ("results[0].goodput.mean"),
    or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return path, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for key, value in items:
        found = _non_finite(value, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def _out_of_range(args: argparse.Namespace, result: dict) -> int | None:
    """A usage error when a result is not a finite number (inputs at float64's edges: `--step-time-s 1e-300` gave inf
    Gbps, `--tokens-per-chip-s 1e308` inf tokens an hour, printed as results and as non-standard JSON), else None."""
    found = _non_finite(result)
    if found is None:
        return None
    where, value = found
    return _usage_error(args, f"the inputs give {where} = {value}, not a finite number: an input is too large or too "
                              "small for float64 arithmetic; give values nearer to a real cluster's")


MAX_SCAVENGE_WINDOWS = 1e6
"""Most availability windows of scavenged learners one replica draws (one at a time): without a bound,
`--scavenge-window-s 1e-6` runs for minutes into gigabytes."""


def _check_paper_grid_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flags `--paper-grid` sets itself (the paper's chip counts, learners and systems), when
    given: they were ignored without a word, while the scenario checks still ran on them (`--chips 5` refused the
    grid, which simulates 150 k chips and more)."""
    given = [flag for flag, value, default in (("--chips", args.chips, None), ("--learners", args.learners, None),
                                               ("--systems", args.systems, ",".join(SYSTEMS)),
                                               ("--sweep-chips", args.sweep_chips, "")) if value != default]
    if given:
        raise ValueError(f"--paper-grid simulates the paper's chip counts, learners and systems itself: drop "
                         f"{', '.join(given)} (the failure model, costs, quorum and simulation flags apply)")


def _check_horizon(scenario: Scenario, sim: SimulationConfig) -> None:
    """ValueError when the simulated horizon of `scenario` is past float64, or holds more scavenge windows than one
    replica draws (`MAX_SCAVENGE_WINDOWS`)."""
    horizon_s = horizon_for(scenario, sim)
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise ValueError(f"mtbi_s={scenario.failures.mtbi_s:g} is invalid: {scenario.layout.chips} chips fail once in "
                         f"{scenario.failures.mtbi_s / scenario.layout.chips:g} s, so {sim.failures} failures take "
                         f"{horizon_s:g} s, past what float64 holds; use a shorter --mtbi-s, more --chips or fewer "
                         "--failures")
    windows = horizon_s / scenario.scavenge.window_s
    if scenario.scavenge.extra_learners and windows > MAX_SCAVENGE_WINDOWS:
        raise ValueError(f"window_s={scenario.scavenge.window_s:g} is invalid: the {horizon_s:.3g} s simulated would "
                         f"hold about {windows:.3g} availability windows, each drawn in turn (at most "
                         f"{MAX_SCAVENGE_WINDOWS:.0e}); give a longer window or fewer --failures")


def _run_goodput(args: argparse.Namespace) -> int:
    from ddiloco.plan import report

    try:
        if args.paper_grid:
            _check_paper_grid_flags(args)
        systems = _systems(args.systems)
        chips_list = _int_list("--sweep-chips", args.sweep_chips) if args.sweep_chips else [None]
        scenarios = [_scenario(args, chips) for chips in chips_list]
        if args.paper_grid:
            overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimulationConfig)
                         if getattr(args, f.name, None) is not None}
            sim = dataclasses.replace(grid_simulation(), **overrides)
        else:
            sim = config_from_args(SimulationConfig, args)
        out = _plot_dir(args)
        for scenario in scenarios:
            _check_horizon(scenario, sim)
    except ValueError as exc:
        return _usage_error(args, _as_flag(exc, GOODPUT_CONFIGS))
    con = report.console()
    if args.paper_grid:
        started = time.perf_counter()
        grid = run_paper_grid(scenarios[0], sim)
        elapsed_s = time.perf_counter() - started
        con.print(report.paper_grid_table(grid, elapsed_s))
        if not args.no_plot:
            con.print(f"plot: {report.plot_paper_grid(grid, out / 'plan_paper_grid.png')}")
        if args.json:
            _print_json(grid.to_json() | {"seconds": round(elapsed_s, 3)})
        return 0
    results, ratios = [], []
    for scenario in scenarios:
        baseline = dataclasses.replace(scenario, scavenge=dataclasses.replace(scenario.scavenge, extra_learners=0))
        for system in systems:
            result = simulate(system, scenario, sim)
            results.append(result)
            if scenario.scavenge.extra_learners:
                without = simulate(system, baseline, sim)
                ratios.append(without.tokens_per_hour.mean / result.tokens_per_hour.mean
                              if result.tokens_per_hour.mean > 0 else math.inf)  # refused below as not finite
    refused = _out_of_range(args, {"results": [r.to_dict() for r in results], "wall_time_vs_no_scavenging": ratios})
    if refused is not None:
        return refused
    con.print(report.goodput_table(results, ratios or None))
    if not args.no_plot:
        con.print(f"plot: {report.plot_goodput(results, out / 'plan_goodput.png')}")
    if args.json:
        payload = {"scenario": dataclasses.asdict(scenarios[0]), "simulation": dataclasses.asdict(sim),
                   "results": [r.to_dict() for r in results]}
        if ratios:
            payload["wall_time_vs_no_scavenging"] = ratios
        _print_json(payload)
    return 0


def _run_bandwidth(args: argparse.Namespace) -> int:
    from ddiloco.plan import report

    try:
        config = config_from_args(BandwidthConfig, args)
        out = _plot_dir(args)
    except ValueError as exc:
        return _usage_error(args, _as_flag(exc, BANDWIDTH_CONFIGS))
    plan = plan_bandwidth(config)
    refused = _out_of_range(args, plan.to_dict())
    if refused is not None:
        return refused
    con = report.console()
    for table in report.bandwidth_tables(plan):
        con.print(table)
    con.print("Assumptions:")
    for line in plan.assumptions:
        con.print(f"  - {line}")
    if not args.no_plot:
        con.print(f"plot: {report.plot_bandwidth(plan, out / 'plan_bandwidth.png')}")
    if args.json:
        _print_json(plan.to_dict())
    return 0
