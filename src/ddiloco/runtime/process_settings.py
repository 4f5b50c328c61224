"""The settings of each process of the real runtime: `ddiloco syncer`, `ddiloco learner`, `ddiloco evaluator`.

One frozen dataclass per role holds everything the process needs besides the run config (addresses, paths,
threads, periods); each field is one flag of that command (`ddiloco.flags`) and one key of its settings file.
`ddiloco run` writes each child's settings as JSON in the run directory (`DIR/settings/NAME.json`) and starts
it with `--settings FILE`; a process started by hand is given the same settings as flags, and flags given
beside `--settings` override the file. The run's algorithm config travels separately, in `config.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ddiloco.checks import invalid, require, require_at_least, require_choice, require_int, require_positive
from ddiloco.flags import as_flag_error, field_types, flag_fields, flag_values, required, setting

DEFAULT_BIND = "127.0.0.1:0"
"""The syncer's listen address: loopback, a free port (written to DIR/syncer.json)."""
DEFAULT_CHECKPOINT_EVERY_S = 10.0
"""A learner's local checkpoint period: a learner killed hard redoes at most this much work."""
DEFAULT_EVAL_EVERY_S = 10.0
"""Seconds between two evaluations of the global model."""
DEFAULT_FULL_STATE_EVERY = 100
"""Rounds between two full states of the syncer: a restart replays at most this many rounds."""
ROUND_FILES = ("recent", "all")
"""What the syncer keeps of `rounds/`: the rounds a restart may replay (after the older kept full state), or all."""
SETTINGS_FLAG = "--settings"

S = TypeVar("S", bound="ProcessSettings")


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What every process of a run is told: where the run lives and how it proves it belongs to it."""

    run_dir: str = setting(metavar="DIR")
    """the run directory"""
    config: str | None = setting(None, metavar="FILE")
    """run config JSON (default: DIR/config.json if present, else defaults); run-config flags override it"""
    token_file: str | None = setting(None, metavar="PATH")
    """file holding the run's shared token, or a learner's own (`ddiloco token`); each command's help says which"""
    token_env: str | None = setting(None, metavar="NAME")
    """environment variable holding the run's shared token (instead of --token-file)"""

    def __post_init__(self) -> None:
        require(isinstance(self.run_dir, str) and bool(self.run_dir), "run_dir", self.run_dir, "a directory")
        # Given empty (`--token-file "$TOKEN"` with TOKEN unset), either one read as "no token": a syncer served
        # without authentication.
        if self.token_file is not None:
            require(_non_blank(self.token_file), "token_file", self.token_file,
                    "the path of a file holding the token")
        if self.token_env is not None:
            require(_non_blank(self.token_env), "token_env", self.token_env,
                    "the name of an environment variable holding the token")
        if self.token_file is not None and self.token_env is not None:
            raise invalid("token_env", self.token_env, "no token_env beside token_file: give one of them")


@dataclass(frozen=True, kw_only=True)
class SyncerSettings(ProcessSettings):
    """`ddiloco syncer`: serves the global model, merges rounds, makes every round durable in DIR."""

    bind: str = setting(DEFAULT_BIND, metavar="HOST:PORT")
    """listen address; port 0 picks a free port, written to DIR/syncer.json (0.0.0.0:PORT serves other machines)"""
    tls_cert: str | None = setting(None, metavar="FILE")
    """PEM certificate: serve over TLS (with --tls-key)"""
    tls_key: str | None = setting(None, metavar="FILE")
    """PEM private key of --tls-cert"""
    allow_no_token: bool = False
    """serve a non-loopback address without a run token (trusted networks only)"""
    resume: bool = False
    """continue from DIR's durable state (done anyway whenever one exists); refused where DIR holds no run"""
    init: str | None = setting(None, metavar="FILE.safetensors")
    """a new run's initial global parameters (default: the first learner's own); the model's parameter names must
    be in it, extra tensors (buffers) are ignored"""
    full_state_every: int = setting(DEFAULT_FULL_STATE_EVERY, metavar="ROUNDS")
    """write the full syncer state every this many rounds; rounds in between are replayed from the round log on
    restart"""
    round_files: str = setting("recent", metavar="recent|all", choices=ROUND_FILES)
    """which rounds' merged tensors (rounds/) to keep: recent, those after the older kept full state (what a restart
    replays), or all, for a replay from the genesis (an audit); every round's line in rounds.jsonl is kept either way"""
    threads: int = 1
    """torch threads of the syncer (its merges are small; the cores belong to the learners)"""
    standby: bool = False
    """wait as a standby: follow the serving syncer's durable state in DIR and take over (serving on --bind) when
    it dies"""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_address("bind", self.bind)
        require_int("full_state_every", self.full_state_every, minimum=1)
        require_choice("round_files", self.round_files, ROUND_FILES)
        require_int("threads", self.threads, minimum=1)


@dataclass(frozen=True, kw_only=True)
class LearnerSettings(ProcessSettings):
    """`ddiloco learner`: the built-in TinyGPT learner, one learner id of the run."""

    syncer: str = setting(metavar="HOST:PORT[,HOST:PORT]")
    """the syncer's address; several, comma-separated, for a syncer and its standbys on other hosts (the learner
    moves to the next when one cannot be reached)"""
    learner_id: int = setting(metavar="N")
    """this learner's id, 0..M-1"""
    link: str | None = setting(None, metavar="BANDWIDTH,LATENCY")
    """emulate a link to the syncer, e.g. 2.5gbit,40ms (default: unshaped)"""
    threads: int | None = None
    """torch threads (default: max(1, cores // learners))"""
    device: str = "cpu"
    """torch device of the model: cpu, cuda, cuda:N"""
    tls_ca: str | None = setting(None, metavar="FILE")
    """PEM CA certificate: connect over TLS, verifying the syncer"""
    tls_server_name: str | None = setting(None, metavar="NAME")
    """name to verify in the syncer's certificate, if not the --syncer host"""
    checkpoint_every_s: float = setting(DEFAULT_CHECKPOINT_EVERY_S, metavar="SECONDS")
    """period of the learner's local checkpoints: a learner killed hard redoes at most this much work"""
    status_every_s: float = setting(1.0, metavar="SECONDS")
    """period of DIR/learners/N/status.json rewrites"""
    chaos_control: str | None = setting(None, metavar="PATH")
    """obey the faults a chaos run writes to this control file (partition, latency, bandwidth, drop, corrupt,
    straggler; see ddiloco.fault_control); default: none"""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_address("syncer", self.syncer, connect=True)
        require_int("learner_id", self.learner_id, minimum=0)
        if self.threads is not None:
            require_int("threads", self.threads, minimum=1)
        require_devices("device", self.device)
        require_positive("checkpoint_every_s", self.checkpoint_every_s, "seconds")
        require_positive("status_every_s", self.status_every_s, "seconds")
        _check_tls_client(self.tls_ca, self.tls_server_name)


@dataclass(frozen=True, kw_only=True)
class EvaluatorSettings(ProcessSettings):
    """`ddiloco evaluator`: the built-in TinyGPT evaluator, a read-only subscriber of the syncer."""

    syncer: str = setting(metavar="HOST:PORT")
    """the syncer's address"""
    every_s: float = setting(DEFAULT_EVAL_EVERY_S, metavar="SECONDS")
    """seconds between evaluations"""
    threads: int = 1
    """torch threads"""
    device: str = "cpu"
    """torch device of the model"""
    connect_timeout_s: float | None = setting(None, metavar="SECONDS")
    """give up (exit status 4) on a syncer that never answered after this many seconds; 0: never; default: the run
    config's learner.connect_timeout_s (120 s), as a learner"""
    tls_ca: str | None = setting(None, metavar="FILE")
    """PEM CA certificate: connect over TLS, verifying the syncer"""
    tls_server_name: str | None = setting(None, metavar="NAME")
    """name to verify in the syncer's certificate, if not the --syncer host"""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_address("syncer", self.syncer, connect=True)
        require_at_least("every_s", self.every_s, 0, "seconds")
        if self.connect_timeout_s is not None:
            require_at_least("connect_timeout_s", self.connect_timeout_s, 0, "seconds (0: never give up)")
        require_int("threads", self.threads, minimum=1)
        require_devices("device", self.device)
        _check_tls_client(self.tls_ca, self.tls_server_name)


def _non_blank(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def require_address(field: str, value: object, *, connect: bool = False) -> None:
    """`value` must be HOST:PORT (`connect`: one or more, comma-separated, none with port 0, which only a listener
    may be given: the syncer picks a free port and writes it to DIR/syncer.json)."""
    from ddiloco.transport.auth import split_host_port

    require(_non_blank(value), field, value, "HOST:PORT")
    assert isinstance(value, str)
    for address in value.split(",") if connect else [value]:
        try:
            _, port = split_host_port(address.strip())
        except ValueError as exc:
            raise ValueError(f"{field}={value!r} is invalid: {str(exc).partition(' is invalid: ')[2]}") from None
        if connect and port == 0:
            raise ValueError(f"{field}={value!r} is invalid: port 0 is where the syncer is told to pick a port; give "
                             "the port it serves on (its log's `serving on HOST:PORT`, or DIR/syncer.json)")


def require_devices(field: str, value: object) -> None:
    """`value` must be one or more torch devices, comma-separated (`cpu`, `cuda`, `cuda:1`): their names, not
    whether this machine has them (`devices_here`)."""
    import torch

    require(_non_blank(value), field, value, "one or more torch devices, comma-separated")
    assert isinstance(value, str)
    for part in value.split(","):
        try:
            torch.device(part.strip())
        except (RuntimeError, ValueError):
            raise invalid(field, value, f"a torch device (cpu, cuda, cuda:N, ...), not {part.strip()!r}") from None


def devices_here(flag: str, value: str) -> None:
    """The devices of `value` (checked by `require_devices`) exist on this machine: a learner that would train on a
    GPU this machine lacks is refused before anything starts (it failed at its model's `.to`, after the run began)."""
    import torch

    for part in value.split(","):
        device = torch.device(part.strip())
        if device.type != "cuda":
            continue
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{flag} {value}: this machine has no CUDA device (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{flag} {value}: {device} does not exist, this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1})")


def _check_tls_client(tls_ca: str | None, tls_server_name: str | None) -> None:
    """A name to verify in the syncer's certificate means nothing without TLS: refused rather than ignored."""
    if tls_server_name is not None and tls_ca is None:
        raise invalid("tls_server_name", tls_server_name, "no tls_server_name without tls_ca: the name is verified "
                      "only over TLS; give tls_ca too, or drop tls_server_name")


# ---- the settings file -----------------------------------------------------------------------------------

def save_settings(path: str | Path, settings: ProcessSettings) -> Path:
    """Write `settings` as JSON, atomically (a child started at any moment reads a whole file)."""
    from ddiloco.checkpoint import atomic_write_json

    path = Path(path)
    atomic_write_json(path, dataclasses.asdict(settings))
    return path


def _read_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{SETTINGS_FLAG} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{SETTINGS_FLAG} {path} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SETTINGS_FLAG} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{SETTINGS_FLAG} {path}: expected a JSON object of settings, got {json.dumps(data)}")
    return data


def settings_file_values(cls: type[ProcessSettings], path: str | Path) -> dict[str, Any]:
    """The fields a settings file gives, each checked against its field's type (a ValueError naming the file,
    the field and the value otherwise)."""
    from ddiloco.run_config import typed_value

    path = Path(path)
    data = _read_object(path)
    kinds = field_types(cls)
    unknown = sorted(set(data) - set(kinds))
    if unknown:
        raise ValueError(f"{SETTINGS_FLAG} {path}: unknown setting(s) {', '.join(unknown)} for {cls.__name__}")
    values = {}
    for name, value in data.items():
        kind, optional = kinds[name]
        if value is None and optional:
            values[name] = None
            continue
        try:
            values[name] = typed_value(name, value, kind)
        except ValueError as exc:
            raise ValueError(f"{SETTINGS_FLAG} {path}: {exc}") from None
    return values


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """The settings of this process: its `--settings` file (if any) with the flags given on top. A bad value is
    one ValueError naming it as the user gave it: by its flag, or by its key in the file."""
    path = getattr(args, "settings", None)
    from_file = settings_file_values(cls, path) if path else {}
    from_flags = flag_values(cls, args)
    values = {**from_file, **from_flags}
    missing = [flag for flag, f in flag_fields(cls).items() if required(f) and f.name not in values]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)} (or {SETTINGS_FLAG} FILE)")
    try:
        return cls(**values)
    except ValueError as exc:
        name = str(exc).partition("=")[0]
        if name in from_flags or path is None:
            raise as_flag_error(exc, cls) from None
        raise ValueError(f"{SETTINGS_FLAG} {path}: {exc}") from None


def settings_argv(settings: ProcessSettings) -> list[str]:
    """The flags that give `settings` by hand (each field that differs from its default), for docs and tests."""
    argv: list[str] = []
    for flag, f in flag_fields(type(settings)).items():
        value = getattr(settings, f.name)
        if not required(f) and value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv

