"""Warm standby processes: replacing a crashed process without paying for a new interpreter.

A process restarted from scratch spends most of its start-up importing torch and, when it builds its
first optimizer, `torch._dynamo`: about 1.9 s on an idle core, 5-6 s on a machine whose cores are busy
training (measured in `ddiloco chaos` runs). A standby
is a `python -m ddiloco.runtime.standby --preload MODULE ...` process that has already done that work
and waits on its stdin for a role: one JSON line `{"module", "args", "log"}`. It then sends its output
to the role's log and runs `python -m MODULE ARGS...` in place (`runpy`), so the role runs exactly as
a freshly started process would, with the same pid, process group and exit status; only the imports
are already done.

`StandbyPool` keeps `size` of them for one kind of role (learners, data-parallel ranks), started by the
`Launcher` like every child (own process group, death with the launcher, thread-limited OpenMP).
`hand_out()` runs a role in one that is still alive; the pool starts its replacement `refill_delay_s`
later, so the new standby's imports do not compete with the restarted process's own start. The replacement
takes the lowest free name (`NAME-1` ... `NAME-size`), so a long run's restarts append to those logs rather
than add one per restart. A standby
imports at a lower CPU priority (`--nice`, `DEFAULT_NICE`) where it may take the normal priority back
(root, or RLIMIT_NICE): on cores busy training, its imports then use idle time rather than the
learners'; the role's arrival restores the priority of every thread at once. A standby that keeps dying
while it waits makes the pool give up (restarts are then cold). A standby whose owner goes away reads
end-of-file and exits; `close()` stops every standby still waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import queue
import resource
import runpy
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddiloco.checks import invalid, require_int
from ddiloco.runtime.child_process import ChildProcess, stop_processes
from ddiloco.runtime.launcher import Launcher

logger = logging.getLogger(__name__)

STANDBY_MODULE = "ddiloco.runtime.standby"
TORCH_LAZY = ("torch._dynamo",)
"""What torch imports lazily on first use: building the first optimizer imports torch._dynamo (about 800
modules, sympy among them: 0.9 s on an idle core)."""
LEARNER_PRELOAD = ("ddiloco.cli", "ddiloco.runtime.process_commands", "ddiloco.train_tinygpt",
                   "ddiloco.transport.grpc_client", "ddiloco.fault_control", *TORCH_LAZY)
"""What a learner process imports before its first step (torch, grpc, the model, the data pipeline)."""
DEFAULT_REFILL_DELAY_S = 5.0
DEFAULT_NICE = 10
"""A standby imports at this much lower CPU priority (where it can take the priority back for its role):
on a machine whose cores are all training, its imports then take idle time instead of the learners'."""
STOP_TIMEOUT_S = 5.0
MAX_FAILED_STANDBYS = 3
"""Standbys that die while waiting, in a row, after which the pool gives up (restarts are then cold):
a standby that cannot even import its modules would otherwise be started again at every poll."""


def role_message(module: str, args: Sequence[str], log: str) -> bytes:
    """The line a standby reads: run `python -m module args...`, output appended to `log`."""
    return (json.dumps({"module": module, "args": list(args), "log": log}) + "\n").encode()


def module_command(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """(module, args) of an argv `[this interpreter, "-m", module, args...]`, else None: only such a
    command can be handed to a standby, which is this interpreter with its imports done."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


def parse_role(line: str) -> dict[str, Any]:
    """The role in a line from the owner; ValueError naming what is wrong."""
    try:
        role = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"standby: the role is not JSON ({exc}): {line[:200]!r}") from None
    if not isinstance(role, dict):
        raise ValueError(f"standby: the role must be a JSON object, got {line[:200]!r}")
    module, args, log = role.get("module"), role.get("args"), role.get("log")
    if not isinstance(module, str) or not module:
        raise ValueError(f"standby: the role's 'module' must be a module name, got {module!r}")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"standby: the role's 'args' must be a list of strings, got {args!r}")
    if not isinstance(log, str) or not log:
        raise ValueError(f"standby: the role's 'log' must be a file path, got {log!r}")
    return role


def _redirect_output(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def may_restore_priority(base: int) -> bool:
    """Whether this process may give its threads back nice value `base` once it has lowered their
    priority: root, or an RLIMIT_NICE that allows it (unprivileged processes usually may not)."""
    if os.geteuid() == 0:
        return True
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    except (AttributeError, OSError, ValueError):
        return False
    return soft == resource.RLIM_INFINITY or soft >= 20 - base


def _restore_priority(base: int) -> None:
    # Linux keeps a nice value per thread: every thread of the process gets `base` back.
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(tid), base)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {STANDBY_MODULE}",
                                     description="Import modules, then wait on stdin for a role to run.")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="a module to import while waiting (repeatable)")
    parser.add_argument("--nice", type=int, default=0,
                        help="import and wait at this much lower CPU priority, given back when the role arrives "
                             "(ignored where the process could not take it back)")
    args = parser.parse_args(argv)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    niced = args.nice > 0 and sys.platform == "linux" and may_restore_priority(base)
    if niced:
        os.nice(args.nice)
    # The role is read by its own thread, so a role that arrives while the imports still run gives the
    # process its priority back at once: it then finishes them at full speed, as a cold start would.
    lines: queue.Queue[str] = queue.Queue()

    def read_role() -> None:
        line = sys.stdin.readline()
        if niced:
            _restore_priority(base)
        lines.put(line)

    threading.Thread(target=read_role, name="standby-role", daemon=True).start()
    started = time.monotonic()
    for module in args.preload:
        importlib.import_module(module)
    print(f"standby pid {os.getpid()}: {len(args.preload)} module(s) imported in "
          f"{time.monotonic() - started:.1f} s{f' at nice +{args.nice}' if niced else ''}; waiting for a role",
          flush=True)
    line = lines.get()
    if not line:
        print(f"standby pid {os.getpid()}: no role (owner gone or pool closed); exiting", flush=True)
        return 0
    role = parse_role(line)
    print(f"standby pid {os.getpid()}: role {role['module']} {' '.join(role['args'])}", flush=True)
    _redirect_output(role["log"])
    sys.argv = [role["module"], *role["args"]]
    runpy.run_module(role["module"], run_name="__main__", alter_sys=True)
    return 0


class StandbyPool:
    """`size` warm standby processes for one kind of role (see the module docstring)."""

    def __init__(self, launcher: Launcher, *, size: int, name: str, preload: Sequence[str], threads: int,
                 refill_delay_s: float = DEFAULT_REFILL_DELAY_S, clock: Callable[[], float] = time.monotonic,
                 on_start: Callable[[ChildProcess], None] | None = None, nice: int = DEFAULT_NICE) -> None:
        require_int("size", size, minimum=0)
        if not refill_delay_s >= 0:
            raise invalid("refill_delay_s", refill_delay_s, "seconds >= 0")
        self.launcher = launcher
        self.size = size
        self.name = name
        self.preload = tuple(preload)
        self.threads = threads
        self.refill_delay_s = refill_delay_s
        self.nice = nice
        self._clock = clock
        self._on_start = on_start or (lambda child: None)
        self._waiting: list[ChildProcess] = []
        self._refill_at: list[float] = []
        self.pids: list[int] = []
        """Every standby pid this pool started (handed out or not)."""
        self.handed_out = 0
        self.failed_in_a_row = 0
        self.gave_up: str | None = None
        """Why the pool stopped starting standbys (they kept dying while waiting), or None."""

    def fill(self) -> None:
        """Start standbys up to `size`, except those whose refill is not yet due."""
        dead = [c for c in self._waiting if c.poll() is not None]
        self._waiting = [c for c in self._waiting if c.returncode is None]
        for child in dead:
            self._standby_died(child)
        if self.gave_up is not None:
            return
        now = self._clock()
        self._refill_at = [t for t in self._refill_at if t > now]
        while len(self._waiting) + len(self._refill_at) < self.size:
            self._start_one()

    def hand_out(self, name: str, argv: Sequence[str]) -> ChildProcess | None:
        """Run `argv` in a waiting standby as child `name`: the started child, or None when no standby is
        waiting or `argv` is not `[this interpreter, "-m", module, ...]` (the caller starts it cold)."""
        command = module_command(argv)
        if command is None:
            return None
        while self._waiting:
            standby = self._waiting.pop(0)
            if standby.poll() is not None:
                self._standby_died(standby)
                continue
            child = self._hand_role(standby, name, list(argv), *command)
            if child is None:
                continue
            self.handed_out += 1
            self.failed_in_a_row = 0
            self._refill_at.append(self._clock() + self.refill_delay_s)
            return child
        return None

    def close(self) -> None:
        """Stop every standby still waiting (end-of-file first, so it exits by itself)."""
        for standby in self._waiting:
            standby.close_stdin()
        stop_processes(self._waiting, STOP_TIMEOUT_S)
        self._waiting = []
        self._refill_at = []

    def _hand_role(self, standby: ChildProcess, name: str, argv: list[str], module: str,
                   args: list[str]) -> ChildProcess | None:
        """Turn a waiting standby into child `name` running `python -m module args...`, logging where a fresh
        start of `name` would; None if the standby is gone."""
        log_path = self.launcher.paths.log(name)
        with log_path.open("ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start in standby pid {standby.pid}: "
                      f"{' '.join(argv)}\n".encode())
            offset = log.tell()
        assert standby.popen.stdin is not None, "a standby is started with stdin_pipe=True"
        try:
            standby.popen.stdin.write(role_message(module, args, str(log_path)))
            standby.popen.stdin.close()
        except (BrokenPipeError, ValueError):
            return None
        logger.info("[%s] runs in standby pid %d", name, standby.pid)
        return ChildProcess(name, argv, standby.popen, log_path, offset, time.monotonic())

    def _standby_died(self, child: ChildProcess) -> None:
        self.failed_in_a_row += 1
        tail = child.log_tail(1)
        logger.warning("[%s] standby exited with %s while waiting%s", child.name, child.returncode,
                       f": {tail[-1]}" if tail else "")
        if self.failed_in_a_row >= MAX_FAILED_STANDBYS and self.gave_up is None:
            self.gave_up = (f"{self.failed_in_a_row} standbys in a row exited while waiting (last: {child.name}, "
                            f"exit {child.returncode}); restarts are cold from now on; see {child.log_path}")
            logger.warning("[%s] %s", self.name, self.gave_up)

    def _free_name(self) -> str:
        """`NAME-K` with the lowest K from 1 that no waiting standby holds: a pool of `size` keeps its names, and so
        its logs (`logs/NAME-K.log`, appended to), within 1..size however many standbys it uses up. A standby handed
        out is its role's child from then on (its output goes to the role's log), and one that died waits no more:
        neither holds its name."""
        held = {child.name for child in self._waiting}
        return next(name for k in range(1, len(held) + 2) if (name := f"{self.name}-{k}") not in held)

    def _start_one(self) -> None:
        argv = [sys.executable, "-m", STANDBY_MODULE, "--nice", str(self.nice)]
        for module in self.preload:
            argv += ["--preload", module]
        child = self.launcher.start(self._free_name(), argv, self.threads, stdin_pipe=True)
        self.pids.append(child.pid)
        self._waiting.append(child)
        self._on_start(child)


if __name__ == "__main__":
    sys.exit(main())
