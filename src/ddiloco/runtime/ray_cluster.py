"""The Ray instance a `ddiloco run --ray` works in: joined, or started on this machine and stopped after.

A local instance (`--ray` without an address) is started with `ray.init(address="local", num_cpus=...)`,
sized to what the run reserves, so its actors never wait for CPUs that a 2-core machine does not have (Ray's
CPUs are scheduling tokens, not cores). `address="local"` makes it a new instance every time: without an address
`ray.init` joins the cluster that `RAY_ADDRESS` or a `ray start` on this machine names, and refuses `num_cpus`
there. Its processes (GCS, raylet, agents, workers) are the driver's descendants;
`shutdown()` records them, calls `ray.shutdown()` and then waits for every one to be gone, SIGKILLing by pid
any that outlive `SHUTDOWN_WAIT_S` (Ray's agents can linger after their raylet). A joined cluster is only
disconnected from: its processes are not the run's. Ray's own process-management is used as it is; this
module adds only the accounting that proves the run left nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddiloco.launcher_watch import process_start_time, process_stats
from ddiloco.runtime.ray_options import RayOptions, import_ray

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 30.0
"""How long the local instance's processes may take to exit after `ray.shutdown()` before SIGKILL."""
POLL_S = 0.1
LOCAL_ADDRESS = "local"
"""`ray.init`'s address for "start a new instance here", whatever `RAY_ADDRESS` or `ray start` (its
`/tmp/ray/ray_current_cluster`) says."""


RAY_JOIN_HELP = ("start one with `ray start --head` on this machine, give its address as --ray HOST:PORT, or use "
                 "--ray alone for a Ray instance of the run's own")
"""How to get a cluster to join, in `ddiloco run`'s flags."""


def _ray_words(exc: Exception) -> str:
    """Ray's reason without its advice, which names flags of `ray`'s own CLI (`--address`) that `ddiloco run` has
    not."""
    return str(exc).split(" Please specify", 1)[0].rstrip(".")


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid, fields in process_stats():
        children.setdefault(int(fields[1]), []).append(pid)
    found: dict[int, int] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        started = process_start_time(pid)
        if started is not None and pid not in found:
            found[pid] = started
            stack.extend(children.get(pid, []))
    return found


def still_running(processes: dict[int, int]) -> list[int]:
    """The pids of `processes` (pid -> start time) that still run as the same process."""
    return [pid for pid, started in processes.items() if process_start_time(pid) == started]


@dataclass
class RayCluster:
    """Connects the driver to Ray (`start`) and leaves it (`shutdown`); see the module docstring."""

    options: RayOptions
    num_cpus: float = 0.0
    """CPUs a local instance gets (at least this machine's cores, at least what the run reserves)."""
    started_local: bool = False
    local_processes: dict[int, int] = field(default_factory=dict)
    """pid -> start time of the local instance's processes seen so far."""

    def start(self, *, cpus_needed: float) -> str:
        """Join the cluster or start the local instance; a line saying which, for the run's log."""
        ray = import_ray()
        quiet = {"logging_level": logging.WARNING, "log_to_driver": False, "include_dashboard": False}
        # ray.init replaces the driver's SIGTERM handler with sys.exit; `ddiloco run` stops cleanly on SIGTERM.
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            if self.options.local:
                self.num_cpus = max(float(os.cpu_count() or 1), math.ceil(cpus_needed))
                ray.init(address=LOCAL_ADDRESS, num_cpus=self.num_cpus, **quiet)
                self.started_local = True
                self.note_processes()
                return f"started a local Ray instance ({self.num_cpus:g} CPUs, pids {sorted(self.local_processes)})"
            try:
                ray.init(address=self.options.address, **quiet)
            except ConnectionError as exc:
                raise ValueError(f"--ray {self.options.address}: cannot join the Ray cluster: {_ray_words(exc)} "
                                 f"({RAY_JOIN_HELP})") from None
        finally:
            if sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
        resources = ray.cluster_resources()
        return (f"joined the Ray cluster at {self.options.address} ({resources.get('CPU', 0):g} CPUs, "
                f"{resources.get('GPU', 0):g} GPUs)")

    def resources(self) -> dict[str, float]:
        return dict(import_ray().cluster_resources())

    @staticmethod
    def actor_state(actor: Any) -> tuple[str, str]:
        """(state, why it died) of an actor from the GCS's actor table: `ALIVE`, `RESTARTING`, `DEAD`, ...
        A call to an actor that Ray is restarting fails with the same `ActorDiedError` as one to an actor Ray
        gave up on; only the table tells them apart. (`ray._private.state`: the pinned Ray's own accessor.)"""
        import ray._private.state

        entry = ray._private.state.actors(actor_id=actor._actor_id.hex()) or {}
        cause = re.search(r'error_message: "([^"\n]*)', str(entry.get("DeathCause", "")))
        return str(entry.get("State", "UNKNOWN")), cause.group(1) if cause else ""

    def note_processes(self) -> None:
        """Remember the local instance's current processes (at the start, and before `ray.shutdown()`: what
        runs then is what must be gone after it)."""
        if self.started_local:
            self.local_processes.update(descendants(os.getpid()))

    @property
    def pids(self) -> list[int]:
        return sorted(self.local_processes)

    def shutdown(self, *, wait_s: float = SHUTDOWN_WAIT_S, clock: Callable[[], float] = time.monotonic) -> list[int]:
        """Leave Ray; for a local instance, stop it and wait until its processes are gone. Returns the pids that
        had to be SIGKILLed (empty when Ray stopped them all itself)."""
        ray = import_ray()
        self.note_processes()
        if ray.is_initialized():
            ray.shutdown()
        if not self.started_local:
            return []
        deadline = clock() + wait_s
        while still_running(self.local_processes) and clock() < deadline:
            time.sleep(POLL_S)
        survivors = still_running(self.local_processes)
        for pid in survivors:
            logger.warning("[ray] pid %d still runs %.0f s after ray.shutdown(): SIGKILL", pid, wait_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return survivors
