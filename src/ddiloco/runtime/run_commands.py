"""`ddiloco run`: the main job. One command starts a syncer and M learners on this machine.

Resolves the run config (defaults, `--config FILE`, or the run directory's own `config.json` with
`--resume`; flags on top, and on `--resume` only those the run can take, `run_config.RESUMABLE`), the
learner command (on `--resume` without one, the run's own), each learner's ranks and devices and whether an evaluator
runs (on `--resume` without `--nproc-per-learner`, `--device` or `--[no-]evaluate`, the run's own:
`run_dir.LAUNCH_SHAPE`), checks the run directory can be written (and, on `--resume`, that the run is not still
going) and the command's program exists, and only then writes `DIR/config.json`, which every child reads, and the
command's record (`run_dir`). Then it supervises the children (`supervisor`), shows progress (`progress`), turns
SIGINT, SIGTERM and SIGHUP into a clean stop of every child (a second one kills at once), and at the end writes the
report (`report`, `report_table`): merged metrics, summary.json, plots and a table. Exit status: 0 when every learner
finished, 1 when one was refused or failed or the syncer could not run, 128 + signal when stopped,
2 for bad input (a flag, the config file, the run directory) before anything starts. A start that fails before any
process of the run ran (Ray could not be started or joined) leaves the run directory as it found it
(`run_dir.undo_start`). With `--ray` the children are Ray actors (`ray_supervisor`, docs/clusters.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco import interrupts
from ddiloco.build_info import build_id
from ddiloco.exit_status import EXIT_FAILED

if TYPE_CHECKING:  # imported where used: `ddiloco --help` builds this parser without them
    from ddiloco.run_config import RunConfig
    from ddiloco.runtime.launcher import LaunchConfig
    from ddiloco.runtime.process_lock import DirectoryLock
    from ddiloco.runtime.ray_options import RayOptions
    from ddiloco.runtime.run_dir import RunDirBefore
    from ddiloco.runtime.run_settings import RunSettings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PIPE_COLUMNS = 140
"""Output width when stdout is not a terminal (rich would assume 80 and truncate the summary table)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ddiloco.flags import add_config_flags
    from ddiloco.run_config import add_run_config_flags
    from ddiloco.runtime.ray_options import add_ray_flags
    from ddiloco.runtime.run_dir import LAUNCH_SHAPE
    from ddiloco.runtime.run_settings import RunSettings

    parser = subparsers.add_parser(
        "run", help="start a syncer and M learner processes on this machine and supervise them",
        usage="ddiloco run [flags] [-- COMMAND ...]",
        description="Start a syncer and M learner processes here, restart any that die, show progress, and "
                    "write a run directory (config.json, metrics.jsonl, rounds.jsonl, summary.json, plots). "
                    "After --, the learner command: M copies of your script (e.g. -- python train.py ARGS) "
                    "that call ddiloco.session, each told its place in the run by DDILOCO_* environment "
                    "variables (docs/your_model.md); without one, the built-in TinyGPT learner. "
                    "Ctrl-C stops every process cleanly; --resume RUN_DIR continues a stopped run. --ray runs them "
                    "as Ray actors, on a cluster or a Ray instance started here (docs/clusters.md).")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the run writes everything (default: runs/run-<timestamp>, a new one for each run)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue a stopped run from its directory (its config.json), with its learner command, "
                             "--nproc-per-learner, --device, --threads, --[no-]evaluate, --round-files, "
                             "--full-state-every and --checkpoint-every-s unless given (not --link: give it again); "
                             "--inner-steps and the quorum and learner flags may change it, any other config flag "
                             "that differs is refused")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="start from this run config JSON instead of the defaults")
    parser.add_argument("--no-progress", action="store_true",
                        help="no live table: one line per learner event (automatic when stdout is not a terminal)")
    parser.add_argument("--json", action="store_true", help="print summary.json as the last line of stdout")
    add_config_flags(parser, RunSettings, title="run settings", keep_defaults=True)
    # Left out, these are None rather than the default, so that a --resume keeps the run's own (run_dir.LAUNCH_SHAPE).
    parser.set_defaults(**dict.fromkeys(LAUNCH_SHAPE))
    add_ray_flags(parser)
    add_run_config_flags(parser)


@dataclass(frozen=True)
class ResolvedRun:
    """What `ddiloco run` starts, once every check has passed and the run directory holds its config."""

    run_dir: Path
    config: RunConfig
    script: tuple[str, ...]
    """The learner command (`-- python train.py`): the one given, or on `--resume` without one the run's own; empty:
    the built-in TinyGPT learner."""
    settings: RunSettings
    """`ddiloco run`'s settings, with a `--resume`'s ranks and devices resolved (`run_dir.resumed_launch_shape`)."""
    notes: tuple[str, ...]
    """Lines for the console where `--resume` did not simply run what was given (`resumed_learner_command`,
    `resumed_launch_shape`)."""
    lock: DirectoryLock
    """This launcher's claim on the run directory (`run_dir.claim_run_dir`), released when `ddiloco run` returns."""
    before: RunDirBefore
    """What the run directory held before this command wrote to it, put back if no process of the run starts
    (`run_dir.undo_start`)."""
    replaced_command: dict[str, Any] | None = None
    """The learner command record (`launcher/command.json`) this `--resume` replaced with another command or shape,
    put back if no learner runs with the new one (`run_dir.restore_learner_command`)."""


def _resolve(args: argparse.Namespace, settings: RunSettings, *, local: bool,
             gpus_per_learner: float = 0.0) -> ResolvedRun:
    """The run directory, its resolved RunConfig, the learner command and how each learner starts (its ranks and
    devices), written to DIR/config.json and DIR/launcher/command.json, and the directory claimed for this launcher
    (`run_dir.claim_run_dir`: held until `ResolvedRun.lock` is released). Every check comes first, so a refused
    command writes nothing: a `--resume` of a run that is still going, or one that would change what the run was made
    with (`check_resume`), leaves the directory as it was. `local`: the learners start on this machine, so their
    program must be found here. `gpus_per_learner`: the GPUs Ray gives each learner's actor (`--ray`), one for
    each of its ranks."""
    from ddiloco.run_config import RunConfig, check_resume, fixed_differences, run_config_from_args
    from ddiloco.runtime import run_checks
    from ddiloco.runtime.launcher import require_runnable
    from ddiloco.runtime.run_dir import (
        LAUNCH_SHAPE,
        before_start,
        claim_run_dir,
        fresh_dir,
        nothing_to_train_note,
        prepare_run_dir,
        pruned_rounds_note,
        record_learner_command,
        require_directory,
        require_empty,
        resumed_launch_shape,
        resumed_learner_command,
        undo_start,
    )
    from ddiloco.runtime.run_paths import RunPaths
    from ddiloco.runtime.run_settings import RunSettings
    from ddiloco.runtime.syncer_state import GENESIS_FILE

    given = tuple(getattr(args, "script", ()) or ())
    if settings.built_in_learner and given:
        raise ValueError("--built-in-learner and a learner command after -- name two different learners: give one of "
                         "them")
    with contextlib.ExitStack() as refused:  # a check that fails after the claim gives the directory back
        if args.resume is not None:
            run_dir, flag = Path(args.resume), "--resume"
            if args.run_dir is not None and Path(args.run_dir).resolve() != run_dir.resolve():
                raise ValueError(f"--run-dir {args.run_dir} and --resume {args.resume} name different directories")
            if args.config is not None:
                raise ValueError("--config cannot be combined with --resume: the run keeps its own config.json")
            require_directory(run_dir, flag=flag)
            if not (run_dir / "config.json").is_file():
                raise ValueError(f"--resume {run_dir}: no config.json there; is it a ddiloco run directory?")
            lock = claim_run_dir(run_dir, resume=True)
            refused.callback(lock.release)
            saved = RunConfig.load(run_dir / "config.json")
            config = run_config_from_args(args, saved)
            changed_before_start = ()
            if (run_dir / GENESIS_FILE).exists():
                try:
                    check_resume(saved, config)
                except ValueError as exc:
                    raise ValueError(f"--resume {run_dir}: {exc} (its config.json is unchanged)") from None
            elif changed := fixed_differences(saved, config):  # no learner joined: nothing was made with them yet
                changed_before_start = (f"--resume {run_dir}: the run has no genesis yet (no learner ever joined), so "
                                        f"its settings may change: {', '.join(changed)}",)
            script, script_note = resumed_learner_command(run_dir, config, given, built_in=settings.built_in_learner)
            kept, shape_notes = resumed_launch_shape(
                run_dir, {name: getattr(args, name) for name in LAUNCH_SHAPE if getattr(args, name) is not None},
                {**{name: getattr(RunSettings, name) for name in LAUNCH_SHAPE}, "evaluate": default_evaluator(script)})
            try:
                settings = dataclasses.replace(settings, **kept)
            except ValueError as exc:
                raise ValueError(f"--resume {run_dir}: {RunPaths(run_dir).learner_command}: {exc}") from None
            notes = (*changed_before_start, *([script_note] if script_note is not None else []), *shape_notes,
                     *filter(None, [nothing_to_train_note(run_dir, config)]))
            if settings.round_files == "all" and (pruned := pruned_rounds_note(run_dir)) is not None:
                notes = (*notes, pruned)
        else:
            flag = "--run-dir"
            run_dir = Path(args.run_dir) if args.run_dir is not None else None  # None: runs/run-<time>, made below
            if run_dir is not None:
                require_directory(run_dir, flag=flag)
                require_empty(run_dir, flag=flag, hint=f"use --resume {run_dir} to continue it, or ")
            base = RunConfig.load(args.config) if args.config is not None else None
            config = run_config_from_args(args, base)
            script, notes = given, ()
        if settings.nproc_per_learner > 1 and not script:
            raise ValueError(f"--nproc-per-learner {settings.nproc_per_learner} needs a learner script after -- (e.g. "
                             "-- python train.py): the built-in learner is one process")
        if settings.nproc_per_learner > 1 and 0 < gpus_per_learner < settings.nproc_per_learner:
            raise ValueError(f"--nproc-per-learner {settings.nproc_per_learner} needs a GPU for each rank: give "
                             f"--gpus-per-learner {settings.nproc_per_learner} (not {gpus_per_learner:g})")
        if settings.link is not None:  # a link no learner could stay in the run over: refused before any starts
            from ddiloco.transport.link import check_link, parse_link
            check_link(parse_link(settings.link), heartbeat_timeout_s=config.quorum.heartbeat_timeout_s)
        if script and local:
            require_runnable(script)
        if local:
            run_checks.require_memory_for(config.num_learners * settings.nproc_per_learner + settings.standby_learners)
        if not script:
            run_checks.check_built_in_fragments(config)
        if settings.init is not None:
            has_genesis = run_dir is not None and (run_dir / GENESIS_FILE).exists()
            if has_genesis and args.resume is not None:  # the syncer ignored it, saying so in its log only
                raise ValueError(f"--init {settings.init}: the run in {run_dir} has its initial parameters already "
                                 f"({GENESIS_FILE}); --init starts a new run: leave it out of a --resume")
            run_checks.check_init(Path(settings.init), config, built_in=not script, has_genesis=has_genesis)
        if settings.evaluate is None:  # resolved here, so that the run's record says whether it has an evaluator
            settings = dataclasses.replace(settings, evaluate=default_evaluator(script))
        if run_dir is None:  # a name no other command has, however many start in this second
            run_dir, created = fresh_dir("run", flag=flag)
            before = dataclasses.replace(before_start(run_dir), outermost_created=created)
        else:
            before = before_start(run_dir)
        prepare_run_dir(run_dir, flag=flag)
        if args.resume is None:  # two new runs given one directory at the same instant: the second stops here
            lock = claim_run_dir(run_dir, resume=False)
            refused.callback(lock.release)
            # One that ran in it and ended between the check above and the claim: its files are not this run's.
            require_empty(run_dir, flag=flag, hint=f"use --resume {run_dir} to continue it, or ")
        # Only once the directory is this launcher's: what another one created there is not this command's to remove.
        refused.callback(undo_start, before)
        config.save(run_dir / "config.json")
        replaced = record_learner_command(RunPaths(run_dir), script,
                                          {name: getattr(settings, name) for name in LAUNCH_SHAPE})
        refused.pop_all()
    if config.diloco.sync_every >= config.inner_steps:
        notes = (*notes, f"note: --sync-every {config.diloco.sync_every} is not below --inner-steps "
                         f"{config.inner_steps}: no fragment syncs before the end of training; each learner trains "
                         "alone and the global model is their merged last work")
    return ResolvedRun(run_dir, config, script, settings, notes, lock, before, replaced)


def default_evaluator(script: Sequence[str]) -> bool:
    """Whether a run without `--evaluate` or `--no-evaluate` has an evaluator: the built-in learner has one
    (`ddiloco evaluator`), a script none, since only a script that calls `ddiloco.watch` can be one."""
    return not script


def run_settings_from_args(args: argparse.Namespace) -> RunSettings:
    """`ddiloco run`'s own settings from its flags; a bad value is one line naming the flag."""
    from ddiloco.flags import as_flag_error, config_from_args
    from ddiloco.runtime.run_settings import RunSettings

    try:
        return config_from_args(RunSettings, args)
    except ValueError as exc:
        raise as_flag_error(exc, RunSettings) from None


def launch_config(settings: RunSettings, config: RunConfig, run_dir: Path, *, script: tuple[str, ...],
                  ray_options: RayOptions | None, command: tuple[str, ...]) -> LaunchConfig:
    """What the launcher tells every child (its settings file), from `ddiloco run`'s settings and the run config:
    the one place a `ddiloco run` flag turns into a child's setting."""
    from ddiloco.runtime.launcher import LaunchConfig

    devices = settings.devices
    if ray_options is not None and ray_options.gpus_per_learner > 0:
        devices = ("cuda",)  # the GPUs Ray makes visible to each learner's actor
    threads = settings.threads or (ray_options.learner_threads if ray_options is not None else max(
        1, (os.cpu_count() or 1) // (config.num_learners * settings.nproc_per_learner)))
    bind = settings.bind or (ray_options.default_bind if ray_options is not None else LaunchConfig.bind)
    return LaunchConfig(run_dir=run_dir, num_learners=config.num_learners, threads=threads, bind=bind,
                        link=settings.link, command=command, script=script, devices=devices,
                        evaluator=settings.evaluate if settings.evaluate is not None else default_evaluator(script),
                        eval_every_s=settings.eval_every_s, seed=config.seed,
                        checkpoint_every_s=settings.checkpoint_every_s, nproc_per_learner=settings.nproc_per_learner,
                        round_files=settings.round_files, full_state_every=settings.full_state_every,
                        init=Path(settings.init).resolve() if settings.init is not None else None)


def run(args: argparse.Namespace, *, command: Sequence[str] | None = None,
        supervisor_config: Any = None) -> int:
    """`ddiloco run`. `command` replaces the children's `ddiloco` (tests run fake children)."""
    from ddiloco.runtime.process_settings import devices_here
    from ddiloco.runtime.ray_options import ray_options_from_args

    settings = run_settings_from_args(args)
    if settings.link is not None:
        from ddiloco.transport.link import parse_link
        parse_link(settings.link)  # a bad --link is a usage error here, not a crash loop in every learner
    ray_options = ray_options_from_args(args)  # None: this machine's launcher; else Ray actors (docs/clusters.md)
    if ray_options is None and not getattr(args, "script", None):
        # The built-in learner on a GPU this machine lacks: refused here, not a crash loop in every learner. What a
        # script does with DDILOCO_DEVICE is its own business.
        devices_here("--device", settings.device)
    # Until the supervisor's own stop handlers are in place, a SIGTERM or SIGHUP unwinds as Ctrl-C does, so that the
    # start is undone: Python's default ended the launcher there, leaving a directory the same command refused.
    with interrupts.stop_signals_raise():
        resolved = _resolve(args, settings, local=ray_options is None,
                            gpus_per_learner=ray_options.gpus_per_learner if ray_options is not None else 0.0)
        started: dict[str, list[int]] = {}
        try:
            return _supervise(args, resolved, started, ray_options=ray_options, command=command,
                              supervisor_config=supervisor_config)
        except BaseException:
            if not started:
                _undo_failed_start(resolved)
            raise
        finally:
            resolved.lock.release()


def _undo_failed_start(resolved: ResolvedRun) -> None:
    """Put the run directory back as this command found it: its start failed before any process of the run ran (Ray
    could not be started or joined, the syncer's command could not be executed), so the same command can be given
    again. What cannot be put back is said, with what to do."""
    from ddiloco.runtime.run_dir import undo_start

    left = undo_start(resolved.before)
    if left:
        quoted = shlex.quote(str(resolved.run_dir))
        retry = (f"ddiloco run --resume {quoted}" if resolved.before.paths
                 else f"remove {quoted} and give the same command again, or ddiloco run --resume {quoted}")
        print(f"ddiloco run: no process of the run started, and what the start wrote could not all be removed "
              f"({'; '.join(left)}): to retry, {retry}", file=sys.stderr)


def _supervise(args: argparse.Namespace, resolved: ResolvedRun, started: dict[str, list[int]], *,
               ray_options: RayOptions | None, command: Sequence[str] | None, supervisor_config: Any) -> int:
    """`ddiloco run` once its run directory is resolved and claimed: start, supervise, report. `started`: every pid
    this session started, by child name, filled in as they start (empty: no process of the run ran)."""
    # Everything the end of the run needs (the report too) is imported before its processes start: a package upgraded
    # on disk under a running launcher (`pip install -U`) had the end of the run import the report from the new version
    # beside the old modules (an ImportError, no summary, no plots; a Ctrl-C ended in it with status 1).
    from ddiloco.metrics import JsonlSink
    from ddiloco.runtime import report, report_table  # noqa: F401
    from ddiloco.runtime.launcher import DEFAULT_COMMAND, Launcher
    from ddiloco.runtime.progress import ProgressView
    from ddiloco.runtime.run_dir import record_processes
    from ddiloco.runtime.run_paths import RunPaths
    from ddiloco.runtime.supervised_roles import Event, SupervisorConfig
    from ddiloco.runtime.supervisor import Supervisor
    from ddiloco.stdout_pipe import PipeConsole

    run_dir, config, settings = resolved.run_dir, resolved.config, resolved.settings
    paths = RunPaths(run_dir)
    record_processes(paths, started)  # at once: a `--resume` of this directory now sees that the run is going
    launch = launch_config(settings, config, run_dir, script=resolved.script, ray_options=ray_options,
                           command=tuple(command) if command is not None else DEFAULT_COMMAND)
    threads = launch.threads
    launcher = Launcher(launch)
    # A stdout whose reader went away (`| head`) silences the console; the run and its files go on.
    console = PipeConsole(width=None if sys.stdout.isatty() else PIPE_COLUMNS)
    for note in resolved.notes:
        console.print(note, highlight=False, soft_wrap=True)
    sink = JsonlSink(paths.launcher_metrics)
    sink.event("run_started", pid=os.getpid(), num_learners=config.num_learners, inner_steps=config.inner_steps,
               threads=threads, resume=args.resume is not None, child_command=list(launch.command), ddiloco=build_id())
    progress_holder: list[ProgressView] = []

    def on_event(event: Event) -> None:
        sink.event(event.kind, name=event.name, learner_id=event.learner_id, message=event.message,
                   **event.fields)
        if event.kind == "started":
            # Every pid this session started (each also its process group id), for the operator and tests.
            started.setdefault(event.name, []).append(event.fields["pid"])
            record_processes(paths, started)
        if progress_holder:
            progress_holder[0].on_event(event)

    supervisor_config = supervisor_config or SupervisorConfig(standby_learners=settings.standby_learners,
                                                              standby_syncer=settings.standby_syncer)
    if ray_options is not None:
        from ddiloco.runtime.ray_supervisor import RaySupervisor
        supervisor = RaySupervisor(supervisor_config, launcher=launcher, options=ray_options, on_event=on_event)
    else:
        supervisor = Supervisor(supervisor_config, launcher=launcher, on_event=on_event)
    progress = ProgressView(paths, supervisor, console=console,
                            live=not args.no_progress and console.is_terminal)
    progress_holder.append(progress)
    if not progress.live:
        console.print(f"ddiloco run: {config.num_learners} learners x {config.inner_steps} inner steps, "
                      f"{threads} thread(s) each, run directory {run_dir}", highlight=False, soft_wrap=True)

    def on_signal(signum: int, frame: object) -> None:
        supervisor.request_stop(signal.Signals(signum).name)

    alive = _AliveEvents(sink)
    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    if interrupts.received():  # a Ctrl-C before these handlers, swallowed by an import (`ddiloco.interrupts`)
        supervisor.request_stop(signal.SIGINT.name)
    start = time.monotonic()
    try:
        try:
            with progress:
                supervisor.run(on_tick=lambda: (progress.tick(), alive.tick()))
        except BaseException:
            sink.close()  # a start that failed: `run` may remove the file (`_undo_failed_start`)
            raise
        # The stop handlers stay in place until the report is written: a signal now only asks for a stop that is
        # over (Python's own SIGTERM ended the launcher there, and its SIGINT interrupted it, without a summary).
        return _report(args, resolved, supervisor, console=console, sink=sink, wall_time_s=time.monotonic() - start)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


ALIVE_EVERY_S = 10.0
"""How often the launcher writes an `alive` event to `launcher/metrics.jsonl`: a session whose launcher is killed
(no `run_finished`) counts in the summary's total wall time up to its last event (`report._sessions_wall_s`)."""


class _AliveEvents:
    def __init__(self, sink: Any) -> None:
        self.sink, self.last = sink, time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self.last >= ALIVE_EVERY_S:
            self.last = time.monotonic()
            self.sink.event("alive")


def _no_round_failure(paths: Any) -> str:
    """Why a run whose learners all reached their budget is failed all the same: not one round was committed, so the
    global model (what `ddiloco export` writes) is still the initial one. Such a run read `completed: 0 rounds
    committed`, exit 0 (every learner's model went non-finite at once, its updates withheld)."""
    from ddiloco.checkpoint import read_json_object

    rejections = (read_json_object(paths.syncer_status) or {}).get("rejections") or {}
    refused = sum(int(n) for n in rejections.values() if isinstance(n, int))
    why = (f"the syncer refused every update ({', '.join(f'{n} {reason}' for reason, n in sorted(rejections.items()))})"
           if refused else "no update reached the syncer (a learner withholds one whose pseudo-gradient is not "
           "finite: logs/learner-N.log says so)")
    return f"no round was committed, so the global model is still the initial one: {why}"


def _report(args: argparse.Namespace, resolved: ResolvedRun, supervisor: Any, *, console: Any, sink: Any,
            wall_time_s: float) -> int:
    """The run's outcome, its summary and plots, and what the console says at its end; the exit status."""
    from ddiloco.checkpoint import iter_jsonl, read_json_object, strict_dumps
    from ddiloco.runtime.report import write_report
    from ddiloco.runtime.report_table import print_summary
    from ddiloco.runtime.run_paths import RunPaths
    from ddiloco.runtime.supervised_roles import ChildState
    from ddiloco.stdout_pipe import StdoutLines

    run_dir, config = resolved.run_dir, resolved.config
    paths = RunPaths(run_dir)
    final_states = {s.learner_id: (str(s.state), s.reason) for s in supervisor.learners if s.learner_id is not None}
    unfinished = [s for s in supervisor.learners if s.state in (ChildState.REFUSED, ChildState.FAILED)]
    trained = len(final_states) == config.num_learners and all(state == ChildState.DONE
                                                                for state, _ in final_states.values())
    if supervisor.stop_reason is not None and not trained:  # a stop once every learner is done interrupts nothing
        outcome = "interrupted"
    elif supervisor.failure is not None or unfinished:
        outcome = "failed"
    else:
        outcome = "completed"
    failure = supervisor.failure or "; ".join(f"{s.name} {s.state}: {s.reason}" for s in unfinished) or None
    storage_error = (read_json_object(paths.syncer_status) or {}).get("storage_error")
    if outcome == "completed" and storage_error:  # the learners' budget reached, their last updates not committed
        outcome = "failed"
        failure = (f"the syncer could not commit rounds when the run ended: {storage_error}; the learners' updates "
                   "since its last commit were refused (logs/syncer.log says since when)")
    if outcome == "completed" and next(iter_jsonl(paths.rounds), None) is None:  # no round committed
        outcome, failure = "failed", _no_round_failure(paths)
    if outcome == "failed" and supervisor.syncer_address is None:  # its syncer refused the directory
        from ddiloco.runtime.run_dir import restore_run_records
        if (restored := restore_run_records(resolved.before)) is not None:
            console.print(restored, highlight=False, soft_wrap=True)
    elif resolved.replaced_command is not None and len(unfinished) == config.num_learners:
        from ddiloco.runtime.run_dir import restore_learner_command
        console.print(restore_learner_command(paths, resolved.replaced_command, resolved.script), highlight=False,
                      soft_wrap=True)
    sink.event("run_finished", wall_time_s=wall_time_s, outcome=outcome, stop_reason=supervisor.stop_reason)
    sink.close()
    summary = write_report(paths, num_learners=config.num_learners, outcome=outcome, wall_time_s=wall_time_s,
                           final_states=final_states, failure=failure,
                           evaluator=None if supervisor.evaluator is None else (str(supervisor.evaluator.state),
                                                                                supervisor.evaluator.reason))
    print_summary(summary, console)
    console.print(f"run directory: {run_dir} (summary.json, metrics.jsonl, rounds.jsonl, *.png)",
                  highlight=False, soft_wrap=True)
    resume = f"ddiloco run --resume {shlex.quote(str(run_dir))}"  # pasted as printed, whatever the path holds
    if outcome == "interrupted":
        console.print(f"continue it with: {resume}", highlight=False, soft_wrap=True)
    elif outcome == "failed":  # the same command again is refused: the directory is not empty
        console.print(f"once what failed is fixed, retry it with: {resume}", highlight=False, soft_wrap=True)
    if args.json:
        sys.stdout.flush()
        StdoutLines()(strict_dumps(summary, sort_keys=True)[0])  # a reader gone (a closed terminal): nothing said
    if outcome == "interrupted":
        return _signal_exit_code(supervisor.stop_reason)
    return 0 if outcome == "completed" else EXIT_FAILED




def _signal_exit_code(reason: str | None) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    signum = signal.Signals[reason] if reason in signal.Signals.__members__ else signal.SIGINT
    return 128 + int(signum)
