"""`ddiloco syncer` and `ddiloco learner`: the two processes of the real runtime.

This module turns a process's settings (`ddiloco.runtime.process_settings`: a `--settings FILE` written by
`ddiloco run`, flags on top) and the run config into objects, installs signal handlers, and runs a
`SyncerService` behind a gRPC server or a `LearnerProcess`. The process contract (settings, files in the
run directory, exit codes) is documented in docs/runtime.md; `ddiloco run` builds on it.
Exit codes: 0 done (or stopped by SIGTERM/SIGINT), 2 bad flags, config or run directory, 3 refused by the
syncer, 4 a learner whose syncer never answered (`--connect-timeout-s`), 130 Ctrl-C while starting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

from ddiloco import interrupts
from ddiloco.build_info import build_id
from ddiloco.flags import add_config_flags
from ddiloco.run_config import RUN_FIELDS, SECTIONS, RunConfig, add_run_config_flags, run_config_from_args
from ddiloco.runtime.process_settings import (
    SETTINGS_FLAG,
    EvaluatorSettings,
    LearnerSettings,
    ProcessSettings,
    SyncerSettings,
    devices_here,
    settings_from_args,
)

logger = logging.getLogger(__name__)

ROLES: dict[str, tuple[type[ProcessSettings], tuple[str, ...], tuple[str, ...]]] = {
    "syncer": (SyncerSettings, tuple(SECTIONS), RUN_FIELDS),
    "learner": (LearnerSettings, ("diloco", "learner", "inner", "model", "data"), RUN_FIELDS),
    "evaluator": (EvaluatorSettings, ("diloco", "model", "data"), ()),
}
"""Command -> (its settings, the run config sections and run fields it takes as flags). The syncer takes them all:
started by hand it writes the run's config.json. The others take what they use, the rest (the syncer's quorum
policy) reaches them through the run's config.json."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    syncer = subparsers.add_parser(
        "syncer", help="serve the global model over gRPC (the syncer process)",
        description="Run the syncer: owns the global parameters, merges learners' updates into rounds, makes "
                    "every round durable in the run directory before sending it out.")
    _add_role_flags(syncer, "syncer")
    learner = subparsers.add_parser(
        "learner", help="train one built-in TinyGPT learner against a syncer (a learner process)",
        description="Run the built-in learner (ddiloco.train_tinygpt: TinyGPT on the embedded corpus, through "
                    "ddiloco.session): joins the syncer, trains inner steps on its data shard, exchanges fragments "
                    "in the background, checkpoints its own progress, and leaves after --inner-steps. Your own "
                    "model: `ddiloco run -- python train.py`.")
    _add_role_flags(learner, "learner")
    add_export_parser(subparsers)
    evaluator = subparsers.add_parser(
        "evaluator", help="evaluate the built-in TinyGPT's global model while a run trains",
        description="The built-in evaluator (ddiloco.watch with TinyGPT's validation loss on the held-out tail): a "
                    "read-only subscriber of the syncer, until SIGTERM.")
    _add_role_flags(evaluator, "evaluator")


def _add_role_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """`--settings FILE`, one flag per field of the role's settings, and the run config flags it uses."""
    cls, sections, run_fields = ROLES[role]
    parser.add_argument(SETTINGS_FLAG, metavar="FILE",
                        help="this process's settings as a JSON object, one key per flag below (what `ddiloco run` "
                             "writes, DIR/settings/NAME.json); flags given beside it override it")
    add_config_flags(parser, cls, title=f"{role} settings", enforce_required=False)
    for action in parser._actions:  # each role's own words for the token it is given
        if action.dest == "token_file":
            action.help = TOKEN_FILE_HELP[role]
    add_run_config_flags(parser, sections=sections, run_fields=run_fields)


TOKEN_FILE_HELP = {
    "syncer": "file holding the run token (DIR/token of a run `ddiloco run` made); a call proves it, or a learner's "
              "own token derived from it",
    "learner": "file holding this learner's own token (`ddiloco token --learner N`), or the run token",
    "evaluator": "file holding the run token (DIR/token of a run `ddiloco run` made): an evaluator is the "
                 "operator's, not a learner's",
}


def run(args: argparse.Namespace) -> int:
    if args.command == "export":
        return run_export(args)
    settings = settings_from_args(ROLES[args.command][0], args)
    if args.command == "syncer":
        return run_syncer(settings, args)
    if args.command == "evaluator":
        return run_evaluator(settings, args)
    return run_learner(settings, args)


# ---- shared ------------------------------------------------------------------------------------------

def resolve_run_config(settings: ProcessSettings, args: argparse.Namespace) -> RunConfig:
    """The run config (`--config`, else DIR/config.json, else defaults; the run config flags on top), once the
    run directory is known to be usable: every one of these processes writes there."""
    from ddiloco.runtime.run_dir import prepare_run_dir

    run_dir = Path(settings.run_dir)
    if settings.config:
        base = RunConfig.load(settings.config)
    elif (run_dir / "config.json").is_file():
        base = RunConfig.load(run_dir / "config.json")
    else:
        base = None
    run_config = run_config_from_args(args, base)  # before the directory is made: a bad flag leaves none behind
    prepare_run_dir(run_dir, flag="--run-dir")
    return run_config


def fixed_settings_refused(run_dir: Path, run_config: RunConfig) -> str | None:
    """The settings of `run_config` that differ from those the run in `run_dir` was made with (its config.json) and
    cannot change for it (`run_config.fixed_differences`, what `ddiloco run --resume` refuses), each as its flag with
    both values; None when they agree or the directory holds no run yet."""
    from ddiloco.run_config import fixed_differences

    path = run_dir / "config.json"
    if not path.is_file():
        return None
    refused = fixed_differences(RunConfig.load(path), run_config)
    return ", ".join(refused) if refused else None


def read_token(settings: ProcessSettings, *, run_token: bool = False) -> str | None:
    """The token given (`--token-file` or `--token-env`), or None. `run_token`: it must be the run token (the
    syncer's), not a learner's own."""
    from ddiloco.transport.auth import check_token, read_token_file, require_run_token

    if settings.token_file:
        token, source = read_token_file(settings.token_file), f"--token-file {settings.token_file}"
    elif settings.token_env:
        value = os.environ.get(settings.token_env)
        if value is None:
            raise ValueError(f"--token-env {settings.token_env}: the environment variable is not set")
        source = f"environment variable {settings.token_env}"
        token = check_token(value.strip(), source)
    else:
        return None
    return require_run_token(token, source) if run_token else token


def _on_stop_signals(callback) -> None:
    def handler(signum, frame) -> None:
        logger.info("received %s: stopping", signal.Signals(signum).name)
        callback()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # a closed terminal: not under nohup
        signal.signal(signal.SIGHUP, handler)
    if interrupts.received():  # a Ctrl-C before these handlers, swallowed by an import (`ddiloco.interrupts`)
        callback()


def _set_threads(threads: int) -> None:
    """torch's thread count (the settings have checked it is >= 1)."""
    import torch

    torch.set_num_threads(threads)


# ---- ddiloco syncer ---------------------------------------------------------------------------------------

def run_syncer(settings: SyncerSettings, args: argparse.Namespace) -> int:
    from ddiloco.transport.auth import check_bind, read_tls_files, split_host_port

    run_dir = Path(settings.run_dir)
    if settings.resume and not settings.standby and not (run_dir / "config.json").is_file():
        # A mistyped directory started a new run there, saying so only in the log.
        raise ValueError(f"--resume {run_dir}: no run there (no config.json): check the path, or leave --resume out "
                         "to start a new run")
    held_before = set(os.listdir(run_dir)) if run_dir.is_dir() else None
    token = read_token(settings, run_token=True)  # these before the run directory is made
    check_bind(settings.bind, token, allow_no_token=settings.allow_no_token)
    tls = read_tls_files(settings.tls_cert, settings.tls_key)
    run_config = resolve_run_config(settings, args)
    refused = fixed_settings_refused(run_dir, run_config)
    if refused:
        raise ValueError(f"the run in {run_dir} cannot change {refused} (its config.json is unchanged); only "
                         "--inner-steps and the quorum and learner settings (--min-quorum, --grace, --max-wait-s, ...) "
                         "may change when its syncer restarts")
    _set_threads(settings.threads)

    from ddiloco.checkpoint import atomic_write_json
    from ddiloco.metrics import run_dir_sink
    from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
    from ddiloco.runtime.syncer_standby import SyncerLock, follow_primary
    from ddiloco.runtime.syncer_state import Restored, SyncerStore, load_init_file, read_genesis
    from ddiloco.transport.grpc_server import start_server

    service_config = SyncerServiceConfig(full_state_every_rounds=settings.full_state_every)
    genesis = read_genesis(run_dir)
    init = None
    if settings.init and genesis is not None:
        logger.warning("[syncer] --init %s ignored: the run already has its genesis", settings.init)
    store = SyncerStore(run_dir, keep_round_files=settings.round_files == "all")
    stop = interrupts.StopFlag()  # set by a signal handler: a threading.Event there could wait for ever
    _on_stop_signals(stop.set)
    lock = SyncerLock(run_dir)
    syncer, restored = None, Restored()
    if settings.standby:
        followed = follow_primary(run_dir, run_config, lock, stop)
        if followed is None:
            logger.warning("[syncer] standby stopped before taking over")
            return 0
        syncer, restored = followed
        genesis = read_genesis(run_dir)
    elif not lock.try_acquire():
        raise ValueError(f"another syncer (pid {lock.holder()}) serves {run_dir}: stop it first, or start this one "
                         "with --standby to take over when it dies")
    elif genesis is not None:
        syncer = genesis.syncer(run_config.diloco, run_config.quorum)
        restored = store.restore(syncer)
    if syncer is not None:
        logger.warning("[syncer] resumed at round %d (state at %d + %d replayed from the round log)",
                       syncer.rounds_committed, restored.state_rounds, restored.replayed)
    elif settings.resume:  # its config.json, from a syncer stopped before the first learner joined
        logger.warning("[syncer] --resume: %s holds no genesis yet; starting fresh", run_dir)
    if settings.init and genesis is None:
        init = load_init_file(settings.init)
    sink = run_dir_sink(run_dir / "syncer")
    sink.event("start", source="checkpoint" if genesis is not None else "init",
               rounds_committed=syncer.rounds_committed if syncer is not None else 0, replayed=restored.replayed,
               ddiloco=build_id())
    service = SyncerService(run_config, syncer, store, sink=sink, config=service_config, restored=restored,
                            init=init, init_source=f"--init {settings.init}" if init is not None else "")
    try:
        server, port = start_server(service, settings.bind, token=token, tls=tls)
    except ValueError:  # the address is in use or invalid
        if genesis is None:
            sink.close()
            _forget_start(run_dir, held_before)
        raise
    _save_run_config(run_dir, run_config)
    host, _ = split_host_port(settings.bind)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    service.start(address)
    atomic_write_json(run_dir / "syncer.json", {"pid": os.getpid(), "address": address, "started_at": time.time()})
    logger.warning("[syncer] serving on %s (round %d)", address, service.rounds_committed)
    interrupts.wait_for(stop)  # in slices: a SIGTERM that a gRPC thread received is handled here
    service.close(server)
    logger.warning("[syncer] stopped after %d rounds", service.rounds_committed)
    return 0


def _forget_start(run_dir: Path, held_before: set[str] | None) -> None:
    """A syncer of a new run that could not listen removes what its start wrote (its metrics directory and lock file;
    the directory itself if the start made it), so that the directory reads as new to the next start (`ddiloco run
    --run-dir` refused it as a run to resume)."""
    for name in ("syncer", "syncer.lock"):
        if held_before is None or name not in held_before:
            path = run_dir / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if held_before is None:
        with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
            run_dir.rmdir()


def _save_run_config(run_dir: Path, run_config: RunConfig) -> None:
    """Make DIR/config.json, what every learner reads, say what this syncer serves: a new run's settings, or the
    ones a restart may change (`fixed_settings_refused` has refused the rest). Written once the syncer listens, so
    that a start that fails (a port in use) leaves no config.json to hold the next start to its flags, and before
    DIR/syncer.json, which says it serves."""
    path = run_dir / "config.json"
    if not path.is_file() or RunConfig.load(path) != run_config:
        run_config.save(path)


# ---- ddiloco learner ----------------------------------------------------------------------------------------

def run_learner(settings: LearnerSettings, args: argparse.Namespace) -> int:
    from ddiloco.transport.auth import read_ca_file, token_for_learner
    from ddiloco.transport.link import check_link, parse_link

    token = read_token(settings)  # these before the run directory is made
    if token is not None:
        token_for_learner(token, settings.learner_id)  # another learner's token: refused here, not in a thread
    devices_here("--device", settings.device)
    tls_ca = read_ca_file(settings.tls_ca)
    run_config = resolve_run_config(settings, args)
    refused = fixed_settings_refused(Path(settings.run_dir), run_config)
    if refused:  # else the first learner to join would make its own model the run's genesis
        raise ValueError(f"this learner's settings differ from the run's {Path(settings.run_dir) / 'config.json'}: "
                         f"{refused}; start it without those flags (it takes the run's config.json)")
    if settings.link:
        # The Welcome's duration is the session's to say (it knows the model); the latency is refused here, before
        # torch is set up, as a bad flag.
        check_link(parse_link(settings.link), heartbeat_timeout_s=run_config.quorum.heartbeat_timeout_s)
    threads = settings.threads or max(1, (os.cpu_count() or 1) // run_config.num_learners)
    _set_threads(threads)  # before any torch work (docs/architecture.md)
    if settings.learner_id >= run_config.num_learners:
        raise ValueError(f"--learner-id {settings.learner_id} is invalid: the run has {run_config.num_learners} "
                         f"learners (ids 0..{run_config.num_learners - 1})")

    from ddiloco.exit_status import RefusedError, UnreachableError
    from ddiloco.train_tinygpt import train

    try:
        train(run_config, learner_id=settings.learner_id, device=settings.device, syncer=settings.syncer,
              run_dir=Path(settings.run_dir), token=token, link=settings.link, tls_ca=tls_ca,
              tls_server_name=settings.tls_server_name, chaos_control=settings.chaos_control,
              checkpoint_every_s=settings.checkpoint_every_s, status_every_s=settings.status_every_s)
    except (RefusedError, UnreachableError) as exc:
        print(f"ddiloco learner: {exc}", file=sys.stderr)
        return int(exc.code)
    return 0


# ---- ddiloco evaluator ------------------------------------------------------------------------------------

def run_evaluator(settings: EvaluatorSettings, args: argparse.Namespace) -> int:
    from ddiloco.transport.auth import read_ca_file

    token = read_token(settings)  # these before the run directory is made
    devices_here("--device", settings.device)
    read_ca_file(settings.tls_ca)  # a file that is not a PEM certificate: refused here, before torch is set up
    run_config = resolve_run_config(settings, args)
    if settings.connect_timeout_s is not None:
        run_config = dataclasses.replace(run_config, learner=dataclasses.replace(
            run_config.learner, connect_timeout_s=settings.connect_timeout_s))
    _set_threads(settings.threads)
    from ddiloco.train_tinygpt import evaluate_global

    evaluate_global(run_config, device=settings.device, syncer=settings.syncer, run_dir=Path(settings.run_dir),
                    token=token, every_s=settings.every_s, tls_ca=settings.tls_ca,
                    tls_server_name=settings.tls_server_name)
    return 0


# ---- ddiloco export ---------------------------------------------------------------------------------------

def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="write a run's global model as a safetensors file",
        description="Write the global parameters of the latest committed round of RUN_DIR under the model's own "
                    "parameter names (tied weights under each of their names), and the model's buffers (BatchNorm's "
                    "running statistics) as the mean of the learners' latest, so that "
                    "`model.load_state_dict(safetensors.torch.load_file(FILE))` restores them. Every floating "
                    "tensor is written in one dtype (--dtype), so that a load with assign=True (a model built on "
                    "the meta device) gives a model of one dtype.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    export.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the parameters")
    export.add_argument("--from-learners", action="store_true",
                        help="put the model together from the learners' own copies of the global model "
                             "(RUN_DIR/learners/N/global.safetensors, written with their checkpoints), fragment by "
                             "fragment the newest version one of them holds: for a run whose syncer's state is lost. "
                             "RUN_DIR needs only the learners' directories")
    export.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32",
                        help="the dtype of every floating tensor written, parameters and buffers (default: float32, "
                             "the global model's own: nothing is rounded; integer buffers keep theirs)")


def _export_may_go(target: Path, root: Path) -> bool:
    """Whether an export may be written at `target`, a path inside the run directory `root` (`_check_destination`)."""
    from ddiloco.runtime.syncer_state import GENESIS_FILE

    if target.parent != root or target.suffix != ".safetensors" or target.name == GENESIS_FILE:
        return False
    metadata = _safetensors_metadata(target)
    return not target.exists() or (metadata is not None and "ddiloco_run" in metadata)  # an earlier export, again


def _safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The metadata of the safetensors file at `path` ({} when it has none), or None when it is no such file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            return file.metadata() or {}
    except (SafetensorError, OSError):
        return None


EXPORT_DTYPES = ("float32", "bfloat16", "float16")
"""`ddiloco export --dtype`'s choices: names of torch dtypes."""


def run_export(args: argparse.Namespace) -> int:
    """`ddiloco export`. A path that is not a run directory, an `--out` that is a directory, lies inside the run
    directory or cannot be written, is refused (ValueError: one line, exit status 2), all but a failing write before
    the run's rounds are read."""
    from ddiloco.checkpoint import atomic_write_bytes, canonical_safetensors
    from ddiloco.global_copy import freshest
    from ddiloco.model_buffers import merged_buffers
    from ddiloco.run_config import RunConfig
    from ddiloco.runtime.syncer_state import exported_params

    if not args.out:
        raise ValueError("--out is empty: give a file path such as model.safetensors")
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not args.from_learners and not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} has no config.json: is it a ddiloco run directory?{_from_learners_hint(run_dir)}")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: give a file path such as {out / 'model.safetensors'}")
    _check_destination(out, run_dir)
    target = _export_file(out)
    if args.from_learners:
        recovered = freshest(run_dir)
        params, aliases = recovered.params, recovered.aliases
        held_by = f"learner{'s' if len(recovered.learners) > 1 else ''} {', '.join(map(str, recovered.learners))}"
        versions = ", ".join(map(str, recovered.versions))
        what = f"the global model as {held_by} last held it (fragment versions {versions})"
        origin = {"from_learners": ",".join(map(str, recovered.learners)),
                  "fragment_versions": ",".join(map(str, recovered.versions))}
    else:
        config = RunConfig.load(run_dir / "config.json")
        try:
            params, rounds, aliases = exported_params(run_dir, config.diloco)
        except ValueError as exc:
            raise ValueError(f"{exc}{_from_learners_hint(run_dir)}") from None
        what, origin = f"the global model after {rounds} rounds", {"rounds_committed": str(rounds)}
    buffers, learners = merged_buffers(run_dir)
    import torch
    from safetensors.torch import save

    dtype = getattr(torch, args.dtype)
    # One floating dtype: the parameters are the syncer's float32, the buffers as the learners hold them (bf16 in a bf16
    # model), and a load with assign=True took both as they were (a bf16 buffer in a float32 model failed its forward).
    tensors = {n: t.to(dtype).contiguous() if t.is_floating_point() else t for n, t in {**params, **buffers}.items()}
    data = canonical_safetensors(save(tensors, metadata={  # the same run exported twice: the same bytes
        "ddiloco_run": str(run_dir.resolve()), **origin, "buffers_of_learners": ",".join(map(str, learners))}))
    try:
        atomic_write_bytes(target, data)
    except OSError as exc:  # what the checks before cannot see: /proc, a full disk, a read-only mount
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    count = sum(t.numel() for n, t in params.items() if n not in aliases)  # a tied weight once, as the model has it
    written = out if target == out else f"{out} (the link's file {target})"
    tied = f" (and {len(aliases)} tied under a second name)" if aliases else ""
    print(f"wrote {written}: {_count(len(params) - len(aliases), 'parameter')}{tied}, {count:,} values in "
          f"{args.dtype}, {what}")
    if buffers:
        print(f"  and {_count(len(buffers), 'buffer')}, their mean over learners {', '.join(map(str, learners))} as of "
              "their latest checkpoints (ddiloco.model_buffers)")
    return 0


def _from_learners_hint(run_dir: Path) -> str:
    """What to try when a run directory cannot give its model from the syncer's state but learners' copies are there."""
    from ddiloco.global_copy import learner_copies

    if not learner_copies(run_dir):
        return ""
    return (f" ({run_dir} holds learners' copies of the global model, learners/N/global.safetensors: `ddiloco export "
            f"--from-learners {run_dir} --out FILE` puts the model together from them)")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def _export_file(out: Path) -> Path:
    """The file an export to `out` replaces (by writing a new file and renaming it there): `out`, or where the symlink
    `out` points (the link stays). ValueError for anything but a new path or a safetensors file (an earlier export): a
    FIFO or a device (as root, /dev/full) would have been replaced by a plain file, and a mistyped `--out train.py`
    the user's script."""
    target = out.resolve() if out.is_symlink() else out
    if target.exists() and not target.is_file():
        mode = target.stat().st_mode
        kind = next((f"{name}, " for test, name in _NOT_REGULAR if test(mode)), "")
        raise ValueError(f"--out {out} is {kind}not a regular file: give the path of a new file or of an earlier "
                         "export")
    if target.exists() and _safetensors_metadata(target) is None:
        raise ValueError(f"--out {out} exists and is not a safetensors file: an export replaces only an earlier one; "
                         "remove it first or give another path")
    return target


def _check_destination(out: Path, run_dir: Path) -> None:
    """ValueError when writing `out` would replace one of the run's own files (its config.json, its genesis: the run
    could no longer be resumed or exported), or its directory cannot be made or written. Inside the run directory an
    export may go only at its top level, as a `.safetensors` file that is not the genesis and is new or an earlier
    export (`RUN/export.safetensors`, next to the run it came from): the run's other files and its subdirectories are
    its own."""
    target, root = out.resolve(), run_dir.resolve()
    if target.is_relative_to(root) and not _export_may_go(target, root):
        raise ValueError(f"--out {out} would replace a file of the run directory {run_dir}, which the run needs: write "
                         f"the export elsewhere, e.g. --out {root.parent / 'model.safetensors'}, or as a new "
                         f"{root / 'export.safetensors'}")
    existing = next(p for p in target.parents if p.exists())  # the directories below it are made by the write
    if not existing.is_dir():
        raise ValueError(f"--out {out}: cannot write there ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot write there ({existing} is not writable)")
