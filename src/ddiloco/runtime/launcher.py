"""Starting the processes of a local run: one `ddiloco syncer`, M `ddiloco learner` and an evaluator.

Owns the command lines of the process contract with `ddiloco syncer` / `ddiloco learner` / `ddiloco evaluator`, their
settings files and environments, and starts each as a `ChildProcess` (`ddiloco.runtime.child_process`: its own process
group, gone with the launcher) whose stdout and stderr go to `DIR/logs/`. Where the run's files are is
`ddiloco.runtime.run_paths`; what to start when, and restarts, belong to the supervisor.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import read_json_object
from ddiloco.checks import invalid
from ddiloco.fault_control import control_path
from ddiloco.launcher_watch import process_start_time
from ddiloco.runtime.child_process import ChildProcess, die_with_parent
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
from ddiloco.runtime.run_paths import RunPaths
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
LOOPBACK = "127.0.0.1"
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
"""Bind addresses that mean "every interface": local learners reach them through loopback."""


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
                                     preexec_fn=die_with_parent, close_fds=True)
        logger.info("[%s] started pid %d", name, popen.pid)
        return ChildProcess(name, argv, popen, log_path, offset, time.monotonic())
