"""One role of a run (the syncer, learner N, the evaluator) as a Ray actor that runs its process.

The actor starts exactly the process the local launcher would (`Launcher`: the same command line and
`DDILOCO_*` environment, its own process group, its log in `DIR/logs/`, SIGTERM when the actor dies) and
watches it. That SIGTERM comes from the kernel (`PR_SET_PDEATHSIG`) however the actor's worker ends, so that the
learner checkpoints and leaves as it does when the local launcher dies: the actor runs with `ACTOR_RUNTIME_ENV`,
which stops Ray's worker from SIGKILLing its children first as it exits (it does on an exit Ray orders: the
driver that owned the actor died, or the local raylet did, which dies with the driver of a local instance).

When the process dies in a way the local supervisor would restart (a crash, a signal, a
syncer that never served), the actor ends its own worker process (`os._exit`), so that **Ray** restarts
the role: `max_restarts` counts the restarts, and Ray places the new actor wherever the role's resources
are free, on another node if its node is gone, which a watcher restarting in place could never do. The
new incarnation SIGKILLs what is left of the old process group on this node before it starts again, so
two processes never hold one learner id. An exit that a restart would not change (a learner done, exit 0;
refused, 3; a usage error, 2) is kept and reported by `status()`: the driver ends the actor. So are a learner's
two exits that the local supervisor keeps too (`learner_exits`): a crash after its session had finished (done), and
the last exit of a crash loop (`learner_exits.CrashLoop`: starts in a row that ended with an error before the session
began, or restarts in a row that failed without training further; failed, with the log's last line; the counts ride
from one incarnation to the next in the role's state file).

Where the syncer serves is found through Ray: the syncer actor answers `address()` with the HOST:PORT its
process wrote to `syncer.json` (a wildcard bind replaced by its node's address), and every learner actor
asks it at each start. A restarted syncer binds the port it had, so running learners reconnect by
themselves. `DIR/launcher/ray/NAME.json` carries a role's incarnation count, pid, node, address and last
exit code from one incarnation to the next (the run directory is shared by every node, docs/clusters.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.checks import invalid
from ddiloco.exit_status import EXIT_DONE, EXIT_REFUSED, EXIT_USAGE
from ddiloco.runtime.child_process import ChildProcess, process_group_alive, stop_processes
from ddiloco.runtime.launcher import DEFAULT_COMMAND, WILDCARD_HOSTS, LaunchConfig, Launcher, with_port
from ddiloco.runtime.learner_exits import (
    CrashLoop,
    finished_session,
    status_since,
    stopped_from_outside,
)
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.runtime.supervised_roles import EVALUATOR, SYNCER

logger = logging.getLogger(__name__)

WATCH_POLL_S = 0.1
"""How often the actor looks at its process (and, for the syncer, at syncer.json)."""
ADDRESS_WAIT_S = 5.0
"""One wait for the syncer actor's answer; a learner asks again until `RoleSpec.syncer_wait_s`."""
EXIT_RESTART = 75
"""The actor worker's own exit status when it ends itself for Ray to restart the role (EX_TEMPFAIL)."""
REAP_TIMEOUT_S = 10.0
"""SIGTERM -> SIGKILL wait for a process this actor gives up on (a syncer that never served, a leftover group)."""
LEARNER = "learner"
ACTOR_RUNTIME_ENV = {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}}
"""The role actors' runtime environment. Ray's worker SIGKILLs its child processes when it exits on Ray's order
(`kill_child_processes_on_worker_exit`, on by default, read from the worker's environment); it would SIGKILL the
learner before `PR_SET_PDEATHSIG` SIGTERMs it, and the learner would lose every step since its last periodic
checkpoint. Without it the learner gets SIGTERM when the worker's main thread dies, and `_reap` SIGKILLs whatever
of it a restarted actor finds still running. (Ray 2.58 calls no `__ray_shutdown__` on those exits: an owner's death
is a force kill, a raylet's death a quick exit.)"""


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """What one actor runs. Frozen: Ray hands the same spec to every incarnation."""

    role: str
    """`syncer`, `learner` or `evaluator`."""
    name: str
    """`syncer`, `learner-N`, `evaluator`: its log file and state file names."""
    launch: LaunchConfig
    """The run's launch config, as the local launcher gets it (run_dir absolute)."""
    session: str
    """This `ddiloco run` session's id: a state file from an earlier session is not this role's history."""
    learner_id: int = 0
    bind: str = "127.0.0.1:0"
    """The syncer's listen address (its first incarnation's port; later ones keep the port they got)."""
    cwd: str = ""
    """The driver's working directory: the learner command's relative paths mean the same here."""
    syncer_start_timeout_s: float = 120.0
    """Longest the syncer's process may take to serve before it is killed and the role restarted."""
    syncer_wait_s: float = 120.0
    """Longest a learner's actor waits for the syncer's address before its role is restarted."""
    syncer_actor: str = ""
    """The Ray name of the run's syncer actor, which a learner's actor asks where the syncer serves (by name,
    not by handle: an actor's constructor arguments must survive its restarts)."""
    max_exits_before_session: int = 3
    """A learner's starts in a row that may end with an error before its session began (`SupervisorConfig`)."""
    max_exits_without_progress: int = 3
    """A learner's restarts in a row that may end with an error without training further (`SupervisorConfig`)."""

    def __post_init__(self) -> None:
        if self.role not in (SYNCER, LEARNER, EVALUATOR):
            raise invalid("role", self.role, "syncer, learner or evaluator")
        if not Path(self.launch.run_dir).is_absolute():
            raise ValueError(f"launch.run_dir={self.launch.run_dir} is invalid: every node needs an absolute path")


def restarts_after(role: str, code: int) -> bool:
    """Whether a process of `role` that exited with `code` is brought back (the local supervisor's rules)."""
    if code in (EXIT_USAGE, EXIT_REFUSED):
        return False
    return not (role != SYNCER and code == EXIT_DONE)


class RoleActor:
    """The body of the Ray actor (`ray.remote(RoleActor)`, made by the driver). See the module docstring."""

    def __init__(self, spec: RoleSpec) -> None:
        import ray

        self.spec = spec
        command = spec.launch.command
        if command == DEFAULT_COMMAND or command[1:] == DEFAULT_COMMAND[1:]:
            command = (sys.executable, *DEFAULT_COMMAND[1:])  # this node's interpreter, not the driver's path
        self.launcher = Launcher(dataclasses.replace(spec.launch, command=command))
        self.paths = RunPaths(Path(spec.launch.run_dir))
        self.state_path = self.paths.root / "launcher" / "ray" / f"{spec.name}.json"
        self.node = ray.util.get_node_ip_address()
        previous = read_json_object(self.state_path) or {}
        if previous.get("session") != spec.session:
            previous = {}
        self.previous = previous
        self.incarnation = int(previous.get("incarnation", -1)) + 1
        self._reap(previous)
        if spec.cwd and Path(spec.cwd).is_dir():
            os.chdir(spec.cwd)
        self._stopping = False
        self._kept: dict[str, Any] | None = None
        """Set once the process has ended for good: `verdict` (done, failed; absent: its exit code decides) and
        `reason`."""
        self._crash_loop = CrashLoop.from_json(previous.get("crash_loop"))
        self._outside_stop_step: int | None = previous.get("outside_stop_step")
        """Where the learner's last incarnation stopped by a SIGTERM from outside (`stopped_from_outside`)."""
        self._address: str | None = None
        self.syncer_address = self._wait_for_syncer() if spec.role != SYNCER else None
        # Started from the actor's main thread: PR_SET_PDEATHSIG fires when that thread (the worker) dies.
        self._started_wall = time.time()
        self.child = self._start_child()
        self._write_state()
        threading.Thread(target=self._watch, name=f"watch-{spec.name}", daemon=True).start()

    # ---- start -----------------------------------------------------------------------------------------

    def _reap(self, previous: dict[str, Any]) -> None:
        """SIGKILL the previous incarnation's process group if it still runs here (its actor was killed, and
        the SIGTERM it got may still be saving): a learner id must never have two processes."""
        pid = previous.get("pid")
        if not isinstance(pid, int) or previous.get("node") != self.node or not process_group_alive(pid):
            return
        logger.warning("[%s] the previous process group %d still runs: SIGKILL", self.spec.name, pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while process_group_alive(pid) and time.monotonic() < deadline:
            time.sleep(WATCH_POLL_S)

    def _wait_for_syncer(self) -> str:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        syncer = ray.get_actor(self.spec.syncer_actor)
        deadline = time.monotonic() + self.spec.syncer_wait_s
        while time.monotonic() < deadline:
            try:
                address = ray.get(syncer.address.remote(), timeout=ADDRESS_WAIT_S)
            except (RayActorError, GetTimeoutError):
                # Being restarted (Ray raises ActorDiedError then too); gone for good, the driver ends the run.
                address = None
            if address:
                return address
            time.sleep(WATCH_POLL_S)
        logger.warning("[%s] no syncer address after %.0f s: restarting", self.spec.name, self.spec.syncer_wait_s)
        os._exit(EXIT_RESTART)

    def _start_child(self) -> ChildProcess:
        spec, launcher = self.spec, self.launcher
        if spec.role == SYNCER:
            bind = spec.bind
            old = self.previous.get("address")
            if isinstance(old, str) and self.previous.get("node") == self.node:
                bind = with_port(bind, int(old.rpartition(":")[2]))  # learners reconnect where it was
            return launcher.start_syncer(bind)
        assert self.syncer_address is not None
        if spec.role == EVALUATOR:
            argv = launcher.evaluator_argv(self.syncer_address)
            env = launcher.learner_env(0, self.syncer_address, role=EVALUATOR)
        else:
            argv = launcher.learner_argv(spec.learner_id, self.syncer_address)
            env = launcher.learner_env(spec.learner_id, self.syncer_address)
        return launcher.start(spec.name, argv, launcher.config.threads, env_extra=env)

    def _write_state(self, **extra: Any) -> None:
        atomic_write_json(self.state_path, {"session": self.spec.session, "incarnation": self.incarnation,
                                            "pid": self.child.pid, "node": self.node, "address": self._address,
                                            "worker_pid": os.getpid(), **extra})

    # ---- watch -----------------------------------------------------------------------------------------

    def _watch(self) -> None:
        started = time.monotonic()
        while (code := self.child.poll()) is None:
            if self.spec.role == SYNCER and self._address is None:
                self._address = self._served_address()
                if self._address is not None:
                    self._write_state()
                elif time.monotonic() - started > self.spec.syncer_start_timeout_s:
                    logger.warning("[syncer] not serving after %.0f s: restarting", self.spec.syncer_start_timeout_s)
                    stop_processes([self.child], REAP_TIMEOUT_S)
                    code = self.child.returncode if self.child.returncode is not None else -signal.SIGKILL
                    break
            time.sleep(WATCH_POLL_S)
        if self._stopping:
            return  # stopped on purpose: stop() reports how it ended
        self._kept = self._kept_exit(code)
        if self._kept is not None:
            return  # final: status() reports it, the driver ends the actor
        self._write_state(exit_code=code, log_tail=self.child.log_tail(), crash_loop=self._crash_loop.as_json(),
                          outside_stop_step=self._outside_stop_step)
        logger.warning("[%s] process %d exited with %s: ending the actor for Ray to restart it",
                       self.spec.name, self.child.pid, code)
        os._exit(EXIT_RESTART)

    def _kept_exit(self, code: int) -> dict[str, Any] | None:
        """How an exit of this role's process is kept ({} when its code decides), or None for Ray to restart it."""
        if code == EXIT_DONE and self.spec.role == LEARNER:
            # A SIGTERM that ddiloco run did not send stopped it before the budget (a preemption): brought back, as
            # the local supervisor does, from the checkpoint it saved at the stop.
            status = status_since(self.paths.learner_status(self.spec.learner_id), self._started_wall)
            if stopped_from_outside(status, last_stop_step=self._outside_stop_step):
                self._outside_stop_step = status["inner_step"]
                logger.warning("[%s] stopped at inner step %d by a signal ddiloco run did not send: restarted from "
                               "its checkpoint", self.spec.name, status["inner_step"])
                return None
        if not restarts_after(self.spec.role, code):
            return {}
        if self.spec.role == SYNCER:
            return None
        path = self.paths.learner_status(self.spec.learner_id) if self.spec.role == LEARNER else \
            self.paths.evaluator_status  # the evaluator's "session" begins with its first evaluation
        status = status_since(path, self._started_wall)
        if self.spec.role == LEARNER and finished_session(status):
            return {"verdict": "done"}
        self._crash_loop.count(code, status)
        reason = self._crash_loop.give_up_reason(code, self.child.log_tail(), self.launcher.paths.log(self.spec.name),
                                                 max_before_session=self.spec.max_exits_before_session,
                                                 max_without_progress=self.spec.max_exits_without_progress)
        return None if reason is None else {"verdict": "failed", "reason": reason}

    def _served_address(self) -> str | None:
        bound = self.launcher.syncer_address(self.child.pid)
        if bound is None:
            return None
        host, _, port = bound.rpartition(":")
        return f"{self.node}:{port}" if host in WILDCARD_HOSTS else bound

    # ---- the driver's calls ------------------------------------------------------------------------------

    def address(self) -> str | None:
        """Where learners dial this syncer, once its process serves."""
        return self._address

    def status(self) -> dict[str, Any]:
        """This incarnation, and `returncode` once its process has ended for good, with `verdict` and `reason` where
        the learner rules, not the code, decide (`_kept_exit`). An exit that brings the role back is never reported:
        the actor is about to end itself for Ray to restart it."""
        kept = self._kept
        code = self.child.returncode if kept is not None or self._stopping else None
        return {**(kept or {}), "name": self.spec.name, "incarnation": self.incarnation, "pid": self.child.pid,
                "node": self.node, "worker_pid": os.getpid(), "address": self._address, "returncode": code,
                "previous_exit": self.previous.get("exit_code") if self.incarnation > 0 else None,
                "previous_log_tail": self.previous.get("log_tail") or [],
                "log_tail": self.child.log_tail() if code is not None else []}

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the process (its group, for a wrapper: `ChildProcess.request_stop`), SIGKILL its group after
        `timeout_s`; its exit code."""
        self._stopping = True
        stop_processes([self.child], timeout_s)
        return self.child.returncode
