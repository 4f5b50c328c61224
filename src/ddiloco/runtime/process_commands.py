"""`ddiloco syncer` and `ddiloco learner`: the two processes of the real runtime.

This module turns flags into configs and objects, installs signal handlers, and runs a
`SyncerService` behind a gRPC server or a `LearnerProcess`. The process contract (flags, files in the
run directory, exit codes) is documented in docs/runtime.md; `ddiloco run` builds on it.
Exit codes: 0 done (or stopped by SIGTERM/SIGINT), 2 bad flags, config or run directory, 3 refused by the
syncer, 4 a learner whose syncer never answered (`--connect-timeout-s`), 130 Ctrl-C while starting.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ddiloco.run_config import RunConfig, add_run_config_flags, run_config_from_args

logger = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:0"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    syncer = subparsers.add_parser(
        "syncer", help="serve the global model over gRPC (the syncer process)",
        description="Run the syncer: owns the global parameters, merges learners' updates into rounds, makes "
                    "every round durable in the run directory before sending it out.")
    syncer.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                        help=f"listen address; port 0 picks a free port, written to DIR/syncer.json "
                             f"(default: {DEFAULT_BIND}; 0.0.0.0:PORT serves other machines)")
    _add_common(syncer)
    syncer.add_argument("--tls-cert", metavar="FILE", help="PEM certificate: serve over TLS (with --tls-key)")
    syncer.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    syncer.add_argument("--allow-no-token", action="store_true",
                        help="serve a non-loopback address without a run token (trusted networks only)")
    syncer.add_argument("--resume", action="store_true",
                        help="continue from DIR's durable state (done anyway whenever one exists)")
    syncer.add_argument("--init", metavar="FILE.safetensors",
                        help="a new run's initial global parameters (default: the first learner's own); the "
                             "model's parameter names must be in it, extra tensors (buffers) are ignored")
    syncer.add_argument("--full-state-every", type=int, default=100, metavar="ROUNDS",
                        help="write the full syncer state every this many rounds; rounds in between are "
                             "replayed from the round log on restart (default: 100)")
    syncer.add_argument("--threads", type=int, default=1, help="torch threads of the syncer (default: 1)")
    syncer.add_argument("--standby", action="store_true",
                        help="wait as a standby: follow the serving syncer's durable state in DIR and take over "
                             "(serving on --bind) when it dies")

    learner = subparsers.add_parser(
        "learner", help="train one built-in TinyGPT learner against a syncer (a learner process)",
        description="Run the built-in learner (ddiloco.train_tinygpt: TinyGPT on the embedded corpus, through "
                    "ddiloco.session): joins the syncer, trains inner steps on its data shard, exchanges fragments "
                    "in the background, checkpoints its own progress, and leaves after --inner-steps. Your own "
                    "model: `ddiloco run -- python train.py`.")
    learner.add_argument("--syncer", required=True, metavar="HOST:PORT[,HOST:PORT]",
                         help="the syncer's address; several, comma-separated, for a syncer and its standbys on other "
                              "hosts (the learner moves to the next when one cannot be reached)")
    learner.add_argument("--learner-id", type=int, required=True, metavar="N", help="this learner's id, 0..M-1")
    _add_common(learner)
    learner.add_argument("--link", metavar="BANDWIDTH,LATENCY",
                         help="emulate a link to the syncer, e.g. 2.5gbit,40ms (default: unshaped)")
    learner.add_argument("--threads", type=int, default=None,
                         help="torch threads (default: max(1, cores // learners))")
    learner.add_argument("--device", default="cpu", help="torch device of the model: cpu, cuda, cuda:N (default: cpu)")
    learner.add_argument("--tls-ca", metavar="FILE", help="PEM CA certificate: connect over TLS, verifying the syncer")
    learner.add_argument("--tls-server-name", metavar="NAME",
                         help="name to verify in the syncer's certificate, if not the --syncer host")
    learner.add_argument("--checkpoint-every-s", type=float, default=10.0,
                         help="period of the learner's local checkpoints (default: 10)")
    learner.add_argument("--status-every-s", type=float, default=1.0,
                         help="period of DIR/learners/N/status.json rewrites (default: 1)")
    add_export_parser(subparsers)
    evaluator = subparsers.add_parser(
        "evaluator", help="evaluate the built-in TinyGPT's global model while a run trains",
        description="The built-in evaluator (ddiloco.watch with TinyGPT's validation loss on the held-out tail): a "
                    "read-only subscriber of the syncer, until SIGTERM.")
    evaluator.add_argument("--syncer", required=True, metavar="HOST:PORT", help="the syncer's address")
    _add_common(evaluator)
    evaluator.add_argument("--every-s", type=float, default=10.0, help="seconds between evaluations (default: 10)")
    evaluator.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    evaluator.add_argument("--device", default="cpu", help="torch device of the model (default: cpu)")
    learner.add_argument("--chaos-control", metavar="PATH",
                         help="obey the faults a chaos run writes to this control file (partition, latency, "
                              "bandwidth, drop, corrupt, straggler; see ddiloco.fault_control); default: none")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="the run directory")
    parser.add_argument("--config", metavar="FILE",
                        help="run config JSON (default: DIR/config.json if present, else defaults); flags override it")
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--token-file", metavar="PATH", help="file holding the run's shared token")
    tokens.add_argument("--token-env", metavar="NAME", help="environment variable holding the run's shared token")
    add_run_config_flags(parser)


def run(args: argparse.Namespace) -> int:
    if args.command == "syncer":
        return run_syncer(args)
    if args.command == "export":
        return run_export(args)
    if args.command == "evaluator":
        return run_evaluator(args)
    return run_learner(args)


# ---- shared ------------------------------------------------------------------------------------------

def resolve_run_config(args: argparse.Namespace) -> RunConfig:
    """The run config (`--config`, else DIR/config.json, else defaults; flags on top), once the run directory
    is known to be usable: every one of these processes writes there."""
    from ddiloco.runtime.run_dir import prepare_run_dir

    run_dir = Path(args.run_dir)
    prepare_run_dir(run_dir, flag="--run-dir")
    if args.config:
        base = RunConfig.load(args.config)
    elif (run_dir / "config.json").exists():
        base = RunConfig.load(run_dir / "config.json")
    else:
        base = None
    return run_config_from_args(args, base)


def read_token(args: argparse.Namespace) -> str | None:
    from ddiloco.transport.auth import check_token, read_token_file

    if args.token_file:
        return read_token_file(args.token_file)
    if args.token_env:
        value = os.environ.get(args.token_env)
        if value is None:
            raise ValueError(f"--token-env {args.token_env}: the environment variable is not set")
        return check_token(value.strip(), f"environment variable {args.token_env}")
    return None


def _on_stop_signals(callback) -> None:
    def handler(signum, frame) -> None:
        logger.info("received %s: stopping", signal.Signals(signum).name)
        callback()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _set_threads(threads: int) -> None:
    import torch

    if threads < 1:
        raise ValueError(f"--threads {threads} is invalid: expected >= 1")
    torch.set_num_threads(threads)


# ---- ddiloco syncer ---------------------------------------------------------------------------------------

def run_syncer(args: argparse.Namespace) -> int:
    from ddiloco.transport.auth import check_bind, read_tls_files, split_host_port

    run_config = resolve_run_config(args)
    token = read_token(args)
    check_bind(args.bind, token, allow_no_token=args.allow_no_token)
    tls = read_tls_files(args.tls_cert, args.tls_key)
    _set_threads(args.threads)

    from ddiloco.checkpoint import atomic_write_json
    from ddiloco.metrics import run_dir_sink
    from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
    from ddiloco.runtime.syncer_standby import SyncerLock, follow_primary
    from ddiloco.runtime.syncer_state import Restored, SyncerStore, load_init_file, read_genesis
    from ddiloco.transport.grpc_server import start_server

    service_config = SyncerServiceConfig(full_state_every_rounds=args.full_state_every)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.json").exists():
        run_config.save(run_dir / "config.json")
    genesis = read_genesis(run_dir)
    init = None
    if args.init and genesis is not None:
        logger.warning("[syncer] --init %s ignored: the run already has its genesis", args.init)
    store = SyncerStore(run_dir)
    stop = threading.Event()
    _on_stop_signals(stop.set)
    lock = SyncerLock(run_dir)
    syncer, restored = None, Restored()
    if args.standby:
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
    elif args.resume:
        logger.warning("[syncer] --resume: %s holds no genesis yet; starting fresh", run_dir)
    if args.init and genesis is None:
        init = load_init_file(args.init)
    sink = run_dir_sink(run_dir / "syncer")
    sink.event("start", source="checkpoint" if genesis is not None else "init",
               rounds_committed=syncer.rounds_committed if syncer is not None else 0, replayed=restored.replayed)
    service = SyncerService(run_config, syncer, store, sink=sink, config=service_config, restored=restored,
                            init=init, init_source=f"--init {args.init}" if init is not None else "")
    server, port = start_server(service, args.bind, token=token, tls=tls)
    host, _ = split_host_port(args.bind)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    service.start(address)
    atomic_write_json(run_dir / "syncer.json", {"pid": os.getpid(), "address": address, "started_at": time.time()})
    logger.warning("[syncer] serving on %s (round %d)", address, service.rounds_committed)
    stop.wait()
    service.close(server)
    logger.warning("[syncer] stopped after %d rounds", service.rounds_committed)
    return 0


# ---- ddiloco learner ----------------------------------------------------------------------------------------

def run_learner(args: argparse.Namespace) -> int:
    from ddiloco.transport.auth import read_ca_file
    from ddiloco.transport.grpc_client import parse_addresses
    from ddiloco.transport.link import parse_link

    run_config = resolve_run_config(args)
    token = read_token(args)
    parse_addresses(args.syncer)
    if args.link:
        parse_link(args.link)
    tls_ca = read_ca_file(args.tls_ca)
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // run_config.num_learners)
    _set_threads(threads)  # before any torch work (docs/architecture.md)
    if args.learner_id >= run_config.num_learners:
        raise ValueError(f"--learner-id {args.learner_id} is invalid: the run has {run_config.num_learners} "
                         f"learners (ids 0..{run_config.num_learners - 1})")
    for name in ("checkpoint_every_s", "status_every_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: expected seconds > 0")

    from ddiloco.learner_session import RefusedError, UnreachableError
    from ddiloco.train_tinygpt import train

    try:
        train(run_config, learner_id=args.learner_id, device=args.device, syncer=args.syncer,
              run_dir=Path(args.run_dir), token=token, link=args.link, tls_ca=tls_ca,
              tls_server_name=args.tls_server_name, chaos_control=args.chaos_control,
              checkpoint_every_s=args.checkpoint_every_s, status_every_s=args.status_every_s)
    except (RefusedError, UnreachableError) as exc:
        print(f"ddiloco learner: {exc}", file=sys.stderr)
        return int(exc.code)
    return 0


# ---- ddiloco evaluator ------------------------------------------------------------------------------------

def run_evaluator(args: argparse.Namespace) -> int:
    from ddiloco.transport.grpc_client import parse_addresses

    run_config = resolve_run_config(args)
    token = read_token(args)
    parse_addresses(args.syncer)
    if not args.every_s >= 0:
        raise ValueError(f"--every-s {args.every_s} is invalid: expected seconds >= 0")
    _set_threads(args.threads)
    from ddiloco.train_tinygpt import evaluate_global

    evaluate_global(run_config, device=args.device, syncer=args.syncer, run_dir=Path(args.run_dir), token=token,
                    every_s=args.every_s)
    return 0


# ---- ddiloco export ---------------------------------------------------------------------------------------

def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="write a run's global model as a safetensors file",
        description="Write the global parameters of the latest committed round of RUN_DIR under the model's own "
                    "parameter names (tied weights under each of their names), so that "
                    "`model.load_state_dict(safetensors.torch.load_file(FILE))` restores them.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    export.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the parameters")


def run_export(args: argparse.Namespace) -> int:
    from ddiloco.checkpoint import atomic_write_bytes
    from ddiloco.run_config import RunConfig
    from ddiloco.runtime.syncer_state import exported_params

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} has no config.json: is it a ddiloco run directory?")
    config = RunConfig.load(run_dir / "config.json")
    params, rounds = exported_params(run_dir, config.diloco)
    from safetensors.torch import save

    out = Path(args.out)
    atomic_write_bytes(out, save({n: t.contiguous() for n, t in params.items()},
                                 metadata={"ddiloco_run": str(run_dir.resolve()), "rounds_committed": str(rounds)}))
    count = sum(t.numel() for n, t in params.items())
    print(f"wrote {out}: {len(params)} tensors, {count:,} values, the global model after {rounds} rounds")
    return 0
