"""`ddiloco run --ray [ADDRESS]`: the flags, their config, and the one place Ray is imported from.

Ray is an optional extra (`pip install -e '.[ray]'` in the checkout): nothing here imports it at module level, so
`ddiloco` works without it, and `--ray` without it is a usage error naming the install command, raised
before anything is written. The launcher that uses these options is `ddiloco.runtime.ray_supervisor`.
"""

from __future__ import annotations

import argparse
import math
import socket
from dataclasses import dataclass
from types import ModuleType

from ddiloco.checks import invalid
from ddiloco.flags import add_config_flags, flag_fields, setting

RAY_VERSION = "2.58.0"
"""The Ray release the extra pins (it installs beside torch==2.13.0 without touching it)."""
INSTALL_HINT = f"pip install 'ray=={RAY_VERSION}' (the checkout's extra: pip install -e '.[ray]')"
LOCAL = ""
"""`--ray` without an address: start a Ray instance on this machine for the run, stop it at the end."""
SYNCER_CPUS = 1.0
"""Ray CPUs reserved for the syncer actor: its merges and the round log are one process's work."""
CONNECT_TIMEOUT_S = 5.0
"""How long `--ray HOST:PORT` may take to accept a TCP connection before the run is refused."""
LOCAL_BIND = "127.0.0.1:0"
CLUSTER_BIND = "0.0.0.0:0"
"""The syncer's default bind: loopback on a local instance, every interface on a cluster (learners on other
nodes dial the node's address, which the syncer actor reports)."""


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """Where the run's actors go and what each one reserves."""

    address: str = LOCAL
    """A Ray cluster to join (`auto`, `HOST:PORT`, `ray://HOST:PORT`), or "" for a local instance."""
    cpus_per_learner: float = setting(1.0, metavar="N")
    """with --ray: Ray CPUs each learner actor (and the evaluator) reserves; its torch threads default to this,
    rounded up"""
    gpus_per_learner: float = setting(0.0, metavar="N")
    """with --ray: Ray GPUs each learner actor (and the evaluator) reserves; Ray sets CUDA_VISIBLE_DEVICES for it
    (learners then use cuda)"""

    def __post_init__(self) -> None:
        if not isinstance(self.address, str):
            raise invalid("address", self.address, "a Ray address or '' (local)")
        for name in ("cpus_per_learner", "gpus_per_learner"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: expected a number >= 0")

    @property
    def local(self) -> bool:
        return self.address == LOCAL

    @property
    def learner_threads(self) -> int:
        """torch threads per learner when `--threads` is not given."""
        return max(1, math.ceil(self.cpus_per_learner))

    @property
    def default_bind(self) -> str:
        return LOCAL_BIND if self.local else CLUSTER_BIND

    def cpus_needed(self, *, num_learners: int, evaluator: bool) -> float:
        return SYNCER_CPUS + (num_learners + int(evaluator)) * self.cpus_per_learner

    def gpus_needed(self, *, num_learners: int, evaluator: bool) -> float:
        return (num_learners + int(evaluator)) * self.gpus_per_learner


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                        help="run the syncer and learners as Ray actors (restarted by Ray when they die): on the "
                             "cluster at ADDRESS (auto, HOST:PORT), or without one on a Ray instance started here "
                             f"for the run (needs {INSTALL_HINT}; docs/clusters.md)")
    add_config_flags(parser, RayOptions, skip=("address",), title="Ray (with --ray)", keep_defaults=True)


def ray_options_from_args(args: argparse.Namespace) -> RayOptions | None:
    """The options of `--ray`, or None without it (then the Ray-only flags must keep their defaults)."""
    if args.ray is None:
        for flag, field in flag_fields(RayOptions, skip=("address",)).items():
            if getattr(args, field.name) != field.default:
                raise ValueError(f"{flag} only applies with --ray (Ray reserves it for each learner actor)")
        return None
    if args.standby_learners or args.standby_syncer:
        raise ValueError("--standby-learners and --standby-syncer are for the local launcher: under --ray, Ray "
                         "restarts a dead learner's or syncer's actor itself")
    options = RayOptions(address=args.ray, cpus_per_learner=args.cpus_per_learner,
                         gpus_per_learner=args.gpus_per_learner)
    if options.gpus_per_learner > 0 and args.device not in (None, "cpu"):  # None: not given (`ddiloco run`)
        raise ValueError(f"--device {args.device} cannot be combined with --gpus-per-learner: each learner uses the "
                         "GPUs Ray gives it (cuda, made visible by CUDA_VISIBLE_DEVICES)")
    import_ray()
    check_reachable(options.address)
    return options


def check_reachable(address: str) -> None:
    """A usage error when `--ray HOST:PORT` names a port nothing listens on: `ray.init` would wait minutes for
    it, deaf to Ctrl-C. (`auto` and `ray://` addresses are Ray's to resolve.)"""
    host, sep, port = address.rpartition(":")
    if not sep or not host or address.startswith("ray://") or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ValueError(f"--ray {address}: no Ray cluster answers there ({exc}); give the head node's GCS "
                         "address (HOST:PORT, `ray start --head` prints it) or `auto`") from None


def import_ray() -> ModuleType:
    """The `ray` module, or a usage error naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray, which is not installed ({exc}): {INSTALL_HINT}") from None
    return ray
