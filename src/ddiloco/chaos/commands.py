"""`ddiloco chaos`: the same fault plan against Decoupled DiLoCo, data-parallel and synchronous DiLoCo.

Resolves the plan (`--plan FILE`, a failure model with `--mtbi-per-chip`, or `--quick`) and the run
config (the `ddiloco run` flags; chaos runs default to a 5 s heartbeat timeout and 1 s heartbeats so
that a silent learner is noticed within the plan's time scale), runs each system in turn for the
plan's duration (`ddiloco.chaos.runner`), then analyses every system directory, checks the
invariants and writes the report (`report.md`, `results.json`, plots). `--json` prints
`{"systems": {...}, "invariants": {NAME: bool}}` as the last line of stdout. Exit status: 0 when
every invariant holds, 1 when one does not.

Ctrl-C, SIGTERM and SIGHUP stop the system that is running as its plan's end would (every fault lifted, every
process stopped, `ddiloco.chaos.runner`); the systems that had finished are still analysed and reported, as a
partial comparison that names the system cut short and those not run (`--json` adds "interrupted"). Exit status
then: 128 + the signal's number (130 for Ctrl-C), as `ddiloco run`. A stdout that closes (`| head`) stops the
console lines only: the run goes on and its files are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco import interrupts
from ddiloco.stdout_pipe import StdoutLines

if TYPE_CHECKING:
    from ddiloco.chaos.runner import ChaosSettings

EXIT_INVARIANT_BROKEN = 1
CHAOS_HEARTBEAT_TIMEOUT_S = 5.0
CHAOS_HEARTBEAT_EVERY_S = 1.0
SOAK_WATCHDOG_S = 60.0
"""A soak fails when no round commits for this long."""
DEFAULT_DURATION_S = 120.0
"""Seconds each system trains under a drawn plan (`--mtbi-per-chip`, `--soak`) without `--duration`."""
DEFAULT_PLAN_SEED = 0
DEFAULT_KILL_EVERY_S = 10.0
DEFAULT_CHIPS_PER_LEARNER = 1
DEFAULT_CRASH_RECOVERY = "held"
DRAWN_ONLY = {"chips_per_learner": "--chips-per-learner", "recovery_scale_s": "--recovery-scale-s",
              "crash_recovery": "--crash-recovery"}
"""Flags that shape a plan drawn from the failure model, and mean nothing without `--mtbi-per-chip`. They default
to None, so that one given with another plan is refused rather than ignored."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ddiloco.chaos.runner import ChaosSettings
    from ddiloco.flags import add_config_flags
    from ddiloco.run_config import add_run_config_flags

    parser = subparsers.add_parser(
        "chaos", help="inject real faults into real processes and compare with synchronous training",
        description="Run a fault plan (crashes, hangs, stragglers, partitions, slow or lossy links, syncer crashes) "
                    "against Decoupled DiLoCo, synchronous data-parallel training (DDP over gloo, restarted from its "
                    "checkpoint on any failure) and synchronous DiLoCo (K = M), one after the other on this "
                    "machine; report goodput, uptime, recovery times, validation loss, rounds per minute and bytes, "
                    "and check the runtime's invariants. See docs/chaos.md.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--plan", type=Path, default=None, metavar="FILE",
                        help="a fault plan, YAML or JSON (docs/chaos.md shows the format)")
    source.add_argument("--quick", action="store_true",
                        help="the built-in short plan: one fault of each kind, 40 s per system")
    source.add_argument("--soak", action="store_true",
                        help="a soak: kill -9 learners and the syncer at random (every --kill-every-s on average) "
                             "for --duration, with a watchdog (--watchdog-s) that fails the run if no round commits")
    source.add_argument("--mtbi-per-chip", type=float, default=None, metavar="SECONDS",
                        help="draw crashes from a failure model: mean time between interruptions of one chip")
    parser.add_argument("--chips-per-learner", type=int, default=None,
                        help="with --mtbi-per-chip: chips per learner; a learner fails at chips / mtbi (default 1)")
    parser.add_argument("--recovery-scale-s", type=float, default=None,
                        help="with --mtbi-per-chip: scale of the exponentiated-Weibull recovery time")
    parser.add_argument("--crash-recovery", choices=("held", "restart"), default=None,
                        help="with --mtbi-per-chip: 'held' keeps a crashed learner down for a drawn recovery time "
                             "(a machine being replaced); 'restart' restarts it at once (a process crash) "
                             "(default: held)")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="seconds each system trains under the plan (default: the plan's, or 120)")
    parser.add_argument("--plan-seed", type=int, default=None,
                        help="with --mtbi-per-chip or --soak: seed of the drawn plan (default 0)")
    parser.add_argument("--kill-every-s", type=float, default=None,
                        help="with --soak: mean seconds between kills (default 10)")
    parser.add_argument("--systems", default=",".join(_systems()),
                        help="comma-separated systems to run (default: all: %(default)s)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where everything goes (default: runs/chaos-<timestamp>)")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="start from this run config JSON instead of the defaults")
    parser.add_argument("--uptime-bin-s", type=float, default=5.0,
                        help="uptime counts the bins of this length in which the global model advanced (default 5)")
    parser.add_argument("--cold-restarts", action="store_true",
                        help="start every restarted process from a new interpreter (default: restarts run in warm "
                             "standby processes, two restarts' worth: 2 standby learners for the runtime, 2 M "
                             "standby ranks for data-parallel)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line of stdout")
    # --cold-restarts above is warm_restarts=False; the soak's watchdog defaults to SOAK_WATCHDOG_S.
    add_config_flags(parser, ChaosSettings, skip=("warm_restarts",), title="chaos settings")
    add_run_config_flags(parser)


def _chaos_settings(args: argparse.Namespace) -> ChaosSettings:
    """How each system runs, from the flags; a bad value is one line naming its flag."""
    from ddiloco.chaos.runner import ChaosSettings
    from ddiloco.flags import as_flag_error, config_from_args

    watchdog_s = args.watchdog_s if args.watchdog_s is not None else SOAK_WATCHDOG_S if args.soak else None
    try:
        return config_from_args(ChaosSettings, args, warm_restarts=not args.cold_restarts, watchdog_s=watchdog_s)
    except ValueError as exc:
        raise as_flag_error(exc, ChaosSettings) from None


def _systems() -> tuple[str, ...]:
    from ddiloco.chaos.runner import SYSTEMS
    return SYSTEMS


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line naming it, a flag the chosen plan or the chaos run would silently ignore."""
    from ddiloco.run_config import MAX_SEED

    if getattr(args, "inner_steps", None) is not None:
        raise ValueError(f"--inner-steps {args.inner_steps} is invalid for ddiloco chaos: each system trains for the "
                         "plan's duration, not an inner-step budget: give --duration SECONDS instead")
    if args.mtbi_per_chip is None:
        for name, flag in DRAWN_ONLY.items():
            if getattr(args, name) is not None:
                raise ValueError(f"{flag} applies only to a plan drawn with --mtbi-per-chip: drop it, or draw the "
                                 "plan with --mtbi-per-chip SECONDS")
    if args.kill_every_s is not None and not args.soak:
        raise ValueError("--kill-every-s applies only to --soak: drop it, or run a soak with --soak")
    if args.plan_seed is not None:
        if args.mtbi_per_chip is None and not args.soak:
            raise ValueError("--plan-seed seeds a drawn plan (--mtbi-per-chip, --soak): "
                             + ("a plan file is not drawn: drop it" if args.plan is not None else
                                "the --quick plan is fixed: drop it" if args.quick else "drop it"))
        if not 0 <= args.plan_seed <= MAX_SEED:
            raise ValueError(f"--plan-seed {args.plan_seed} is invalid: expected an integer in 0..{MAX_SEED} "
                             "(2**63 - 1)")
    checks = (("--duration", args.duration, "seconds > 0"), ("--mtbi-per-chip", args.mtbi_per_chip, "seconds > 0"),
              ("--kill-every-s", args.kill_every_s, "seconds > 0"),
              ("--recovery-scale-s", args.recovery_scale_s, "seconds > 0"))
    for flag, value, expected in checks:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {value:g} is invalid: expected {expected}")
    if args.chips_per_learner is not None and args.chips_per_learner < 1:
        raise ValueError(f"--chips-per-learner {args.chips_per_learner} is invalid: expected an integer >= 1")


def _run_config(args: argparse.Namespace) -> Any:
    """The run config every system starts from (`runner.unbounded`: a chaos run ends at its plan's duration, and the
    saved config says so): `--config FILE` or the defaults, the chaos heartbeat defaults for whichever heartbeat field
    the file does not set, then the flags."""
    from ddiloco.chaos.runner import unbounded
    from ddiloco.run_config import RunConfig, run_config_from_args

    base = RunConfig.load(args.config) if args.config is not None else RunConfig()
    raw = json.loads(args.config.read_text(encoding="utf-8")) if args.config is not None else {}
    quorum, learner = raw.get("quorum"), raw.get("learner")
    if not (isinstance(quorum, dict) and "heartbeat_timeout_s" in quorum):
        base = dataclasses.replace(
            base, quorum=dataclasses.replace(base.quorum, heartbeat_timeout_s=CHAOS_HEARTBEAT_TIMEOUT_S))
    if not (isinstance(learner, dict) and "heartbeat_every_s" in learner):
        base = dataclasses.replace(
            base, learner=dataclasses.replace(base.learner, heartbeat_every_s=CHAOS_HEARTBEAT_EVERY_S))
    return unbounded(run_config_from_args(args, base))


def _drawn_duration_s(args: argparse.Namespace, source: str) -> float:
    """The duration of a drawn plan: long enough for the quiet start and end it keeps (`--duration` named if not)."""
    from ddiloco.chaos.plan import DRAWN_MARGIN_S, DRAWN_START_AFTER_S
    from ddiloco.fault_control import MAX_RUN_S

    duration_s = args.duration if args.duration is not None else DEFAULT_DURATION_S
    if duration_s > MAX_RUN_S:
        raise ValueError(f"--duration {duration_s:g} is invalid: expected seconds at most {MAX_RUN_S:g} (a week)")
    shortest_s = DRAWN_START_AFTER_S + DRAWN_MARGIN_S
    if duration_s <= shortest_s:
        raise ValueError(f"--duration {duration_s:g} is too short for {source}: faults are drawn from "
                         f"{DRAWN_START_AFTER_S:g} s after the start to {DRAWN_MARGIN_S:g} s before the end: expected "
                         f"--duration > {shortest_s:g} s")
    return duration_s


def _plan(args: argparse.Namespace, num_learners: int) -> Any:
    from ddiloco.chaos import plan as plans

    seed = DEFAULT_PLAN_SEED if args.plan_seed is None else args.plan_seed
    if args.plan is not None or args.quick:
        if args.plan is not None:
            return plans.load_plan(args.plan, num_learners, duration_s=args.duration)
        return plans.quick_plan(num_learners, duration_s=args.duration)
    if args.soak:
        kill_every_s = DEFAULT_KILL_EVERY_S if args.kill_every_s is None else args.kill_every_s
        return plans.soak_plan(_drawn_duration_s(args, "--soak"), num_learners, kill_every_s=kill_every_s, seed=seed)
    if args.mtbi_per_chip is not None:
        extra = {} if args.recovery_scale_s is None else {"recovery_scale_s": args.recovery_scale_s}
        chips = DEFAULT_CHIPS_PER_LEARNER if args.chips_per_learner is None else args.chips_per_learner
        recovery = DEFAULT_CRASH_RECOVERY if args.crash_recovery is None else args.crash_recovery
        return plans.model_plan(duration_s=_drawn_duration_s(args, "--mtbi-per-chip"), num_learners=num_learners,
                                mtbi_per_chip_s=args.mtbi_per_chip, chips_per_learner=chips, seed=seed,
                                restart=recovery == "restart", **extra)
    raise ValueError("no fault plan: give --plan FILE, --quick, --soak, or --mtbi-per-chip SECONDS")


def _parse_systems(text: str) -> list[str]:
    known = _systems()
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        raise ValueError(f"--systems {text!r} is invalid: expected a comma-separated subset of {', '.join(known)}")
    return [s for s in known if s in systems]


def run(args: argparse.Namespace) -> int:
    with interrupts.stop_signals_raise():
        try:
            return _run(args)
        except interrupts.Stopped as stopped:  # before the systems started (a Ctrl-C there: `ddiloco.cli`)
            print("ddiloco chaos: interrupted", file=sys.stderr)
            return interrupts.exit_code(stopped)


def _run(args: argparse.Namespace) -> int:
    from ddiloco.chaos.report import SETTINGS
    from ddiloco.chaos.runner import RUNTIME_SYSTEMS, run_data_parallel_system, run_runtime_system
    from ddiloco.checkpoint import atomic_write_json
    from ddiloco.runtime.run_dir import new_output_dir

    systems = _parse_systems(args.systems)
    _check_flags(args)
    config = _run_config(args)
    plan = _plan(args, config.num_learners)
    settings = _chaos_settings(args)
    if not args.uptime_bin_s > 0:
        raise ValueError(f"--uptime-bin-s {args.uptime_bin_s} is invalid: expected seconds > 0")
    run_dir = new_output_dir(args.run_dir, "chaos", flag="--run-dir")
    plan.save(run_dir / "plan.json")
    config.save(run_dir / "config.json")
    atomic_write_json(run_dir / SETTINGS, dataclasses.asdict(settings))
    say = StdoutLines()
    say(f"ddiloco chaos: {len(plan.faults)} faults over {plan.duration_s:g} s per system, systems "
        f"{', '.join(systems)}, {config.num_learners} learners, run directory {run_dir}")
    finished: list[str] = []
    for system in systems:
        say(f"[{system}] starting")
        started = time.monotonic()
        try:
            if system in RUNTIME_SYSTEMS:
                run_runtime_system(system, run_dir / system, config, plan, settings, say=say)
            else:
                run_data_parallel_system(run_dir / system, config, plan, settings, say=say)
        except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM or SIGHUP: the runner has stopped the system
            name = interrupts.signal_of(interrupt).name
            say(f"[{system}] interrupted ({name}) after {time.monotonic() - started:.0f} s: every fault lifted, "
                "every process stopped")
            if finished:
                _report(args, run_dir, finished, say, interrupted={
                    "signal": name, "cut_short": system, "not_run": systems[systems.index(system) + 1:]})
            else:
                say(f"no system ran to the end of its plan: nothing to compare; what each wrote is in {run_dir}")
            print("ddiloco chaos: interrupted", file=sys.stderr)
            return interrupts.exit_code(interrupt)
        finished.append(system)
        say(f"[{system}] done in {time.monotonic() - started:.0f} s")
    return _report(args, run_dir, finished, say)


def _report(args: argparse.Namespace, run_dir: Path, systems: list[str], say: StdoutLines, *,
            interrupted: dict[str, Any] | None = None) -> int:
    """Analyse `systems` (those that ran to their end), check the invariants, write and print the report; the exit
    status of a complete run (0: every invariant holds). `interrupted` ({"signal", "cut_short": SYSTEM, "not_run":
    [SYSTEM, ...]}) makes it a partial comparison."""
    from ddiloco.chaos.analysis import analyze_system
    from ddiloco.chaos.invariants import check_invariants
    from ddiloco.chaos.report import summarize_invariants, write_report

    if interrupted is not None:
        left_out = [interrupted["cut_short"], *interrupted["not_run"]]
        say(f"partial comparison of {', '.join(systems)} (not compared: {', '.join(left_out)})")
    systems_results = {system: analyze_system(run_dir / system, uptime_bin_s=args.uptime_bin_s)
                       for system in systems}
    details = {system: check_invariants(run_dir / system) for system in systems}
    report = write_report(run_dir, systems_results, details, interrupted=interrupted)
    results = {"systems": systems_results, "invariants": summarize_invariants(details)}
    if interrupted is not None:
        results["interrupted"] = interrupted
    _print_summary(results, say)
    say(f"report: {report}")
    if args.json:
        say(json.dumps(results, sort_keys=True, default=str))
    return 0 if all(results["invariants"].values()) else EXIT_INVARIANT_BROKEN


def _print_summary(results: dict[str, Any], say: Any) -> None:
    say(f"{'system':<14} {'goodput':>8} {'uptime':>8} {'val loss':>9} {'rounds/min':>11}")
    for system, r in results["systems"].items():
        loss = r.get("final_val_loss")
        say(f"{system:<14} {r['goodput']:>8.1%} {r['uptime']:>8.1%} "
            f"{loss if loss is None else format(loss, '.4f'):>9} {r.get('rounds_per_min') or 0:>11.1f}")
    for name, ok in results["invariants"].items():
        say(f"invariant {name}: {'holds' if ok else 'BROKEN'}")
