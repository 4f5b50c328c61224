"""Starting and stopping the processes of a local run: one `ddiloco syncer` and M `ddiloco learner`.

Owns the command lines of the process contract with `ddiloco syncer` / `ddiloco learner`, the run
directory's paths, and the life of one child process: each child leads its own process group (so a
Ctrl-C in the terminal reaches only `ddiloco run`, and stopping a child also stops anything it
spawned), asks the kernel for SIGTERM when the launcher dies (Linux `PR_SET_PDEATHSIG`, so even a
SIGKILLed launcher leaves nothing running; a script behind a wrapper, which that signal does not reach, watches the
launcher named in its environment: `ddiloco.launcher_watch`), and writes its stdout and stderr to `DIR/logs/`.
Stopping is SIGTERM to the group, then SIGKILL after a timeout. What to start when, and restarts,
belong to the supervisor.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import read_json_object
from ddiloco.checks import invalid
from ddiloco.fault_control import control_path
from ddiloco.launcher_watch import process_start_time
from ddiloco.runtime.process_settings import (
    DEFAULT_CHECKPOINT_EVERY_S,
    DEFAULT_EVAL_EVERY_S,
    DEFAULT_FULL_STATE_EVERY,
    EvaluatorSettings,
    LearnerSettings,
    ProcessSettings,
    SyncerSettings,
    save_settings,
)
from ddiloco.transport.auth import learner_token

logger = logging.getLogger(__name__)

DEFAULT_COMMAND = (sys.executable, "-m", "ddiloco.cli")
"""How a child `ddiloco` is started: the launcher's own interpreter, so the run uses one install."""
BARE_PYTHON = frozenset({"python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}"})
"""A script's first word that means "the Python ddiloco runs in" (`in_this_interpreter`)."""


def in_this_interpreter(script: Sequence[str]) -> list[str]:
    """The script command, with a bare `python` (or `python3`, `python3.X`) as its first word replaced by the
    interpreter this process runs in: the one where torch and ddiloco are installed, as torchrun runs its script,
    whatever `python` the PATH finds (`.venv/bin/ddiloco run -- python train.py` without an activated venv). A
    path (`/opt/env/bin/python`, `./python`) is the user's choice and kept."""
    command = list(script)
    if command and command[0] in BARE_PYTHON:
        command[0] = sys.executable
    return command


def require_runnable(script: Sequence[str]) -> None:
    """ValueError naming the learner command's program when this machine cannot start it (no such program on the
    PATH, no such file, not executable): said once before any process starts, where the OS would otherwise refuse
    it at every learner's start. What the program does with its arguments (a missing train.py) it reports itself."""
    program = in_this_interpreter(script)[0]
    if shutil.which(program) is not None:
        return
    if os.sep not in program:
        why = f"there is no program {program!r} on the PATH"
    elif not Path(program).exists():
        why = f"{program} does not exist"
    else:
        why = f"{program} is not an executable file"
    raise ValueError(f"the learner command `{shlex.join(script)}` cannot start: {why}; check the command after -- "
                     "(e.g. -- python train.py)")


BARE_CUDA = "cuda"
"""A CUDA device without an index: the process's current GPU (`Launcher.rank_devices`)."""
ENV_PREFIX = "DDILOCO_"
"""Prefix of the variables that tell a learner script its place in the run (`ddiloco.environment()`)."""
TORCH_DISTRIBUTED_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                                   "MASTER_PORT"})
TORCH_DISTRIBUTED_PREFIX = "TORCHELASTIC_"
"""The variables torchrun gives its workers, which put a process in a torch.distributed job (`init_process_group`'s
env:// rendezvous, `ddiloco.session`, torchelastic's agent store). A `ddiloco run` started inside a torchrun or SLURM
job has them; none of its children belongs to that job, so `Launcher.start` leaves them out (a learner of several
ranks gets its own group's from `ddiloco.runtime.rank_group`)."""
STOP_POLL_S = 0.05
"""Poll interval while waiting for a signalled process group to go."""
STOP_NOTICE_AFTER_S = 3.0
"""How long after SIGTERM a child that is still running is said to be waited for (`stop_processes`' `on_wait`). A
learner that stops cleanly flushes its updates (up to 1 s) and writes its checkpoint within about this; one that
takes longer is most likely between two step() calls, which is where it notices the SIGTERM."""
PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal the kernel sends a child when its parent thread dies."""
LOOPBACK = "127.0.0.1"
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
"""Bind addresses that mean "every interface": local learners reach them through loopback."""

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


@dataclass(frozen=True)
class RunPaths:
    """Where everything lives in a run directory (the contract's file names)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def syncer_json(self) -> Path:
        return self.root / "syncer.json"

    @property
    def syncer_status(self) -> Path:
        return self.root / "syncer_status.json"

    @property
    def syncer_metrics(self) -> Path:
        return self.root / "syncer" / "metrics.jsonl"

    @property
    def evaluator_metrics(self) -> Path:
        return self.root / "evaluator" / "metrics.jsonl"

    @property
    def evaluator_status(self) -> Path:
        return self.root / "evaluator" / "status.json"

    @property
    def rounds(self) -> Path:
        return self.root / "rounds.jsonl"

    @property
    def launcher_metrics(self) -> Path:
        return self.root / "launcher" / "metrics.jsonl"

    @property
    def processes(self) -> Path:
        return self.root / "launcher" / "processes.json"

    @property
    def learner_command(self) -> Path:
        """The learner command the run last started with (`run_dir.record_learner_command`)."""
        return self.root / "launcher" / "command.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def learner_dir(self, learner_id: int) -> Path:
        return self.root / "learners" / str(learner_id)

    def learner_status(self, learner_id: int) -> Path:
        return self.learner_dir(learner_id) / "status.json"

    def learner_metrics(self, learner_id: int) -> Path:
        return self.learner_dir(learner_id) / "metrics.jsonl"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def settings(self, name: str) -> Path:
        """Child `name`'s settings file (`ddiloco syncer|learner|evaluator --settings FILE`)."""
        return self.root / "settings" / f"{name}.json"


def without_torch_distributed(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the torch.distributed job's variables (TORCH_DISTRIBUTED_ENV, TORCHELASTIC_*)."""
    return {name: value for name, value in env.items()
            if name not in TORCH_DISTRIBUTED_ENV and not name.startswith(TORCH_DISTRIBUTED_PREFIX)}


def connect_address(bound: str) -> str:
    """The address a learner on this machine dials for a syncer bound to `bound`."""
    host, _, port = bound.rpartition(":")
    return f"{LOOPBACK}:{port}" if host in WILDCARD_HOSTS else bound


def with_port(bind: str, port: int) -> str:
    host, _, _ = bind.rpartition(":")
    return f"{host}:{port}"


def _die_with_parent() -> None:
    # Runs in the child between fork and exec (only async-signal-safe work: one syscall). The
    # launcher starts children from its main thread only, so "parent thread died" = launcher died.
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def process_group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class ChildProcess:
    """One started child: its own process group, its log file, and how it ended."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path
    log_offset: int
    started_at: float
    """Monotonic seconds."""
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code once it has exited (negative: killed by that signal), else None."""
        if self.returncode is None:
            self.returncode = self.popen.poll()
            if self.returncode is not None:
                # Anything it left in its group (a helper it spawned) goes with it.
                self.signal_group(signal.SIGKILL)
        return self.returncode

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def close_stdin(self) -> None:
        """End-of-file on a standby's stdin (it exits by itself); nothing for other children."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def stop(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> int:
        """SIGTERM the group, wait up to `timeout_s` for the whole group, then SIGKILL it."""
        stop_processes([self], timeout_s, clock=clock)
        return self.returncode if self.returncode is not None else self.popen.wait()

    def log_tail(self, max_lines: int = 5) -> list[str]:
        """The last non-empty lines this start wrote to its log (for "why did it exit")."""
        try:
            with self.log_path.open("rb") as file:
                file.seek(self.log_offset)
                text = file.read().decode("utf-8", errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-max_lines:]


def stop_processes(children: Sequence[ChildProcess], timeout_s: float, *,
                   clock: Callable[[], float] = time.monotonic,
                   kill_now: Callable[[], bool] = lambda: False,
                   on_wait: Callable[[list[ChildProcess]], None] = lambda pending: None) -> None:
    """SIGTERM every child's group at once; SIGKILL what is left after `timeout_s` (or as soon as
    `kill_now()` turns true, e.g. on a second Ctrl-C). `on_wait(pending)` is called once with the children still
    running STOP_NOTICE_AFTER_S after the SIGTERM, if any, so that the wait can be explained. Returns once every
    group is gone."""
    for child in children:
        if child.poll() is None:
            child.signal_group(signal.SIGTERM)
            # A stopped child (SIGSTOP, a chaos hang, Ctrl-Z) handles its SIGTERM only once it runs again: it was
            # SIGKILLed at the timeout instead, with its work since its last checkpoint.
            child.signal_group(signal.SIGCONT)
    started = clock()
    deadline = started + timeout_s
    noticed = False
    pending = [c for c in children if c.poll() is None]
    while pending and clock() < deadline and not kill_now():
        if not noticed and clock() - started >= STOP_NOTICE_AFTER_S:
            noticed = True
            on_wait(pending)
        time.sleep(STOP_POLL_S)
        pending = [c for c in pending if c.poll() is None]
    waited_s = clock() - started
    why = (f"still running {timeout_s:g} s after SIGTERM" if waited_s >= timeout_s
           else f"SIGKILL asked for (a second stop signal) {waited_s:.1f} s after SIGTERM")  # not a timeout: say so
    for child in pending:
        logger.warning("[%s] %s: SIGKILL", child.name, why)
        child.signal_group(signal.SIGKILL)
    for child in children:
        child.returncode = child.popen.wait()
        child.signal_group(signal.SIGKILL)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What the launcher puts in the children's settings files (`ddiloco.runtime.process_settings`)."""

    run_dir: Path
    """The run directory (contract: config.json, syncer.json, learners/N/, ...)."""
    num_learners: int
    """M, learner processes."""
    threads: int
    """torch threads per learner (`--threads`)."""
    syncer_threads: int = 1
    """torch threads of the syncer (its merges are small; its cores belong to the learners)."""
    bind: str = f"{LOOPBACK}:0"
    """Where the syncer listens; port 0 picks a free port on the first start, kept on restarts."""
    link: str | None = None
    """`--link BANDWIDTH,LATENCY` for every learner, or None for an unshaped link."""
    use_token: bool = True
    """Generate a run token (DIR/token, mode 0600) and hand it to every process."""
    command: tuple[str, ...] = DEFAULT_COMMAND
    """The `ddiloco` executable as an argv prefix (tests put a fake one here)."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    init: Path | None = None
    """A new run's initial global parameters, for the syncer (`--init FILE.safetensors`); None: the first
    learner's own."""
    chaos_control: bool = False
    """Start every learner with `--chaos-control DIR/learners/N/chaos.json` (`ddiloco chaos` injects faults there)."""
    script: tuple[str, ...] = ()
    """The user's learner command (`ddiloco run -- python train.py ARGS`); empty: the built-in TinyGPT learner."""
    devices: tuple[str, ...] = ("cpu",)
    """torch devices dealt to the learners round-robin (`--device cuda:0,cuda:1`)."""
    evaluator: bool = True
    """Also run one evaluator (the script with DDILOCO_ROLE=evaluator; the built-in one without a script)."""
    eval_every_s: float = DEFAULT_EVAL_EVERY_S
    """The evaluator's period (seconds between evaluations of the global model)."""
    seed: int = 0
    """The run's seed, handed to every learner (DDILOCO_SEED) so each builds the same initial model."""
    checkpoint_every_s: float = DEFAULT_CHECKPOINT_EVERY_S
    """Period of every learner's local checkpoints (a learner killed hard redoes at most this much work)."""
    full_state_every: int = DEFAULT_FULL_STATE_EVERY
    """The syncer's full-state period in rounds (`--full-state-every`)."""
    round_files: str = "recent"
    """What the syncer keeps of `rounds/` (`--round-files`): `recent` or `all` (`ddiloco chaos` audits every round)."""
    nproc_per_learner: int = 1
    """torch.distributed ranks per learner (`--nproc-per-learner`): above 1, each learner's script runs as a
    group of ranks with torchrun's environment (`ddiloco.runtime.rank_group`); devices are dealt per rank."""

    def __post_init__(self) -> None:
        if isinstance(self.nproc_per_learner, bool) or not isinstance(self.nproc_per_learner, int) \
                or self.nproc_per_learner < 1:
            raise invalid("nproc_per_learner", self.nproc_per_learner, "an integer >= 1")
        if self.nproc_per_learner > 1 and not self.script:
            raise ValueError(f"nproc_per_learner={self.nproc_per_learner} needs a learner script (-- python "
                             "train.py): the built-in learner is one process")
        if not self.devices or not all(self.devices):
            raise invalid("devices", self.devices, "one or more torch devices")
        if not self.eval_every_s >= 0:
            raise invalid("eval_every_s", self.eval_every_s, "seconds >= 0")
        if self.num_learners < 1:
            raise ValueError(f"num_learners={self.num_learners} is invalid: expected >= 1")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} is invalid: expected >= 1")
        if ":" not in self.bind:
            raise invalid("bind", self.bind, "HOST:PORT")


class Launcher:
    """Builds the contract's command lines and starts children. Stateless besides the token."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.paths = RunPaths(Path(config.run_dir))
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        if config.use_token:
            self._ensure_token()

    def _ensure_token(self) -> None:
        token = self.paths.token
        if not token.exists():
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(os.urandom(24).hex() + "\n")

    def _common_settings(self, learner_id: int | None = None) -> dict[str, Any]:
        """The settings every child shares: the run directory, its config.json, its token file."""
        return {"run_dir": str(self.paths.root), "config": str(self.paths.config),
                "token_file": str(self._token_file(learner_id)) if self.config.use_token else None}

    def _settings_argv(self, role: str, name: str, settings: ProcessSettings) -> list[str]:
        """`ddiloco ROLE --settings FILE`, with `settings` written to the run directory's FILE first (atomically:
        a restart rewrites it while nothing reads it, and a child never sees half a file)."""
        path = save_settings(self.paths.settings(name), settings)
        return [*self.config.command, role, "--settings", str(path)]

    def _token_file(self, learner_id: int | None) -> Path:
        """The run token (the syncer's, the evaluator's), or learner N's own token: a learner process holds only
        its own, so it can act as no other learner (`ddiloco.transport.auth.learner_token`)."""
        if learner_id is None:
            return self.paths.token
        path = self.paths.learner_dir(learner_id) / "token"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            own = learner_token(self.paths.token.read_text().strip(), learner_id)
            tmp = path.with_name(f".token.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(own + "\n")
            os.replace(tmp, path)
        return path

    def syncer_settings(self, bind: str, *, standby: bool = False) -> SyncerSettings:
        return SyncerSettings(bind=bind, threads=self.config.syncer_threads, standby=standby,
                              round_files=self.config.round_files, full_state_every=self.config.full_state_every,
                              init=str(Path(self.config.init).resolve()) if self.config.init is not None else None,
                              **self._common_settings())

    def syncer_argv(self, bind: str, *, standby: bool = False) -> list[str]:
        return self._settings_argv("syncer", "syncer-standby" if standby else "syncer",
                                   self.syncer_settings(bind, standby=standby))

    def device(self, learner_id: int) -> str:
        return self.config.devices[learner_id % len(self.config.devices)]

    def rank_devices(self, learner_id: int) -> list[str]:
        """The device of each rank of learner `learner_id`: the run's devices dealt round-robin over all ranks, rank r
        of learner i getting `devices[(i x N + r) mod len(devices)]`, except that a bare `cuda` dealt to rank r of a
        learner of several ranks is `cuda:r`. Plain `cuda` is each process's current GPU, cuda:0, so every rank
        would share one (NCCL refuses that); `--device cuda --nproc-per-learner N` puts each learner's ranks on GPUs
        0..N-1 of what the learner sees, which under Ray is the actor's own GPUs (its CUDA_VISIBLE_DEVICES)."""
        n = self.config.nproc_per_learner
        dealt = [self.config.devices[(learner_id * n + r) % len(self.config.devices)] for r in range(n)]
        return [f"{BARE_CUDA}:{r}" if device == BARE_CUDA and n > 1 else device for r, device in enumerate(dealt)]

    def ranks_file(self, learner_id: int) -> Path:
        """Where a learner of several ranks lists their pids (`ddiloco.runtime.rank_group`)."""
        return self.paths.learner_dir(learner_id) / "ranks.json"

    def learner_argv(self, learner_id: int, syncer_address: str) -> list[str]:
        """The user's script as it stands (its place in the run travels in `learner_env`), or the built-in
        `ddiloco learner` with flags."""
        if self.config.script and self.config.nproc_per_learner > 1:
            return [sys.executable, "-m", "ddiloco.runtime.rank_group", "--nproc", str(self.config.nproc_per_learner),
                    "--devices", ",".join(self.rank_devices(learner_id)), "--pids-file",
                    str(self.ranks_file(learner_id)), "--", *in_this_interpreter(self.config.script)]
        if self.config.script:
            return in_this_interpreter(self.config.script)
        settings = self.learner_settings(learner_id, syncer_address)
        return self._settings_argv("learner", f"learner-{learner_id}", settings)

    def learner_settings(self, learner_id: int, syncer_address: str) -> LearnerSettings:
        """The built-in `ddiloco learner`'s settings."""
        chaos = str(control_path(self.paths.learner_dir(learner_id))) if self.config.chaos_control else None
        return LearnerSettings(syncer=syncer_address, learner_id=learner_id, threads=self.config.threads,
                               device=self.device(learner_id), checkpoint_every_s=self.config.checkpoint_every_s,
                               link=self.config.link, chaos_control=chaos, **self._common_settings(learner_id))

    def evaluator_argv(self, syncer_address: str) -> list[str]:
        """The user's script (in the evaluator role, by `learner_env`), or the built-in `ddiloco evaluator`."""
        if self.config.script:
            return in_this_interpreter(self.config.script)
        settings = EvaluatorSettings(syncer=syncer_address, threads=self.config.threads,
                                     every_s=self.config.eval_every_s, **self._common_settings())
        return self._settings_argv("evaluator", "evaluator", settings)

    def learner_env(self, learner_id: int, syncer_address: str, *, role: str = "learner") -> dict[str, str]:
        """A learner's place in the run, for `ddiloco.environment()` (docs/your_model.md lists the variables)."""
        env = {"SYNCER": syncer_address, "LEARNER_ID": str(learner_id), "NUM_LEARNERS": str(self.config.num_learners),
               "RUN_DIR": str(self.paths.root), "CONFIG": str(self.paths.config), "DEVICE": self.device(learner_id),
               "ROLE": role, "SEED": str(self.config.seed), "THREADS": str(self.config.threads),
               "EVAL_EVERY_S": str(self.config.eval_every_s), "CHECKPOINT_EVERY_S": str(self.config.checkpoint_every_s)}
        if self.config.use_token:
            env["TOKEN_FILE"] = str(self._token_file(learner_id if role == "learner" else None))
        if self.config.link:
            env["LINK"] = self.config.link
        if self.config.chaos_control and role == "learner":
            env["CHAOS_CONTROL"] = str(control_path(self.paths.learner_dir(learner_id)))
        # This process, which the child's session watches: PR_SET_PDEATHSIG reaches only a direct child, not a script
        # run through a wrapper (`bash wrap.sh`, `uv run`), which would outlive a killed launcher (launcher_watch).
        started = process_start_time(os.getpid())
        if started is not None:
            env.update(LAUNCHER_PID=str(os.getpid()), LAUNCHER_STARTED=str(started))
        return {ENV_PREFIX + name: value for name, value in env.items()}

    def start_syncer(self, bind: str, *, standby: bool = False) -> ChildProcess:
        """The syncer, or (`standby`) a standby syncer that takes over on `bind` when it dies."""
        if standby:
            return self.start("syncer-standby", self.syncer_argv(bind, standby=True), self.config.syncer_threads)
        return self.start("syncer", self.syncer_argv(bind), self.config.syncer_threads)

    def syncer_address(self, pid: int) -> str | None:
        """The address the syncer with this pid serves on, once it has written syncer.json."""
        info = read_json_object(self.paths.syncer_json)
        if info is None or info.get("pid") != pid or not isinstance(info.get("address"), str):
            return None
        return info["address"]

    def start(self, name: str, argv: list[str], threads: int, *, stdin_pipe: bool = False,
              env_extra: Mapping[str, str] | None = None) -> ChildProcess:
        """Start any child the way the run's own are started: own process group, log file, thread limits,
        death with the launcher (the data-parallel baseline starts its ranks with it), and none of the
        torch.distributed variables of a job this launcher runs in (`without_torch_distributed`: each learner would
        otherwise set up a process group on that job's MASTER_PORT). `stdin_pipe`: a pipe to its stdin instead of
        /dev/null (a standby reads its role there)."""
        log_path = self.paths.log(name)
        env = without_torch_distributed(os.environ)
        # OpenMP/MKL pools sized before torch even starts, matching --threads (docs/architecture.md).
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
        env.update(self.config.extra_env)
        env.update(env_extra or {})
        with log_path.open("ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
            log.flush()
            offset = log.tell()
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent, close_fds=True)
        logger.info("[%s] started pid %d", name, popen.pid)
        return ChildProcess(name, argv, popen, log_path, offset, time.monotonic())
