"""One learner as a group of N ranks: `python -m ddiloco.runtime.rank_group --nproc N -- python train.py`.

`ddiloco run --nproc-per-learner N` starts this in place of the learner's script (the supervisor sees one
child per learner, as always). It starts the script N times with torchrun's environment (`RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`, `ROLE_WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`), so a script written for torchrun runs unchanged, and each learner has its
own rendezvous: a free port on 127.0.0.1, picked at every start, so no two learners' process groups ever
meet. The ranks stay in this process's process group (the supervisor's stop and kill reach them all) and
get SIGTERM if it dies (`PR_SET_PDEATHSIG`).

It fails fast, as torchrun does with no restarts of its own: when a rank exits with a failure (kill -9, a
crash, or a gloo/NCCL error once a peer is gone) the others are stopped (SIGTERM, SIGKILL after
`STOP_GRACE_S`) and it exits with the status of the rank that failed first, or dies of the same signal where that
rank was killed (kill -9, the OOM killer) or crashed in native code, so that the supervisor counts it as it counts a
learner of one process; it restarts the learner's whole group, which rejoins like any restarted learner. The
rank that failed first is not always the first to exit: each rank's session records when an exception left
its block, in a folder the group gives it (`ddiloco.rank_failures`), and the group names that rank. Exit statuses
that mean "do not restart" (2 usage, 3 refused) pass through unchanged. It exits 0 when every rank has.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ddiloco import rank_failures
from ddiloco.checkpoint import atomic_write_json
from ddiloco.environment import ENV_PREFIX
from ddiloco.runtime.child_process import die_with_parent
from ddiloco.runtime.launcher import LOOPBACK

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How often the ranks' exits are checked."""
STOP_GRACE_S = 5.0
"""After one rank failed, how long the others get to exit on SIGTERM before SIGKILL (they are stuck in a
collective with the dead rank, or failing out of one), and how long the rank that failed first, when another
exited before it, gets to exit by itself."""
FAILURES_DIR = "rank_failures"
"""The folder, beside the `--pids-file`, where the ranks record their failures (`ddiloco.rank_failures`)."""
FAILED_RANK = "[rank-group] rank %d (pid %d) exited with status %d: stopping the other ranks"
"""What the group logs of the first rank that failed (its status as `exit_status` gives it)."""
FAILED_RANK_LINE = re.compile(r"\[rank-group\] rank (\d+) \(pid (\d+)\) exited with status (\d+)")
"""`FAILED_RANK` in a log line: how the supervisors tell which rank's error ended the learner
(`learner_exits.reason_line`: the other ranks fail after it, in a collective with it)."""


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now (the rendezvous binds it a moment later, as torchrun --standalone does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, device: str | None) -> dict[str, str]:
    """torchrun's variables for `rank` of a one-machine group of `nproc` (and its device, when dealt)."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
           "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
           "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}
    if device is not None:
        env["DDILOCO_DEVICE"] = device
    return env


def exit_status(code: int) -> int:
    """A rank's status as a shell reports it: 128 + N for a rank killed by signal N."""
    return 128 - code if code < 0 else code


def run_group(argv: Sequence[str], *, nproc: int, devices: Sequence[str] = (), pids_file: Path | None = None) -> int:
    """Start `argv` as ranks 0..nproc-1 and wait; returns the exit code of the rank that failed first as `subprocess`
    gives it (-N for a rank killed by signal N, so that a script's own `exit(137)` is not taken for a kill -9), or 0."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} is invalid: expected >= 1")
    if not argv:
        raise ValueError("no command to start: pass it after --")
    port = free_port()
    ranks: list[subprocess.Popen] = []
    if pids_file is not None:
        # Beside the pids, in the learner's directory: a group SIGKILLed (a hung learner stopped) left a folder in /tmp
        # at every such stop; here the next start of the learner replaces it.
        failures = pids_file.parent / FAILURES_DIR
        shutil.rmtree(failures, ignore_errors=True)
        failures.mkdir(parents=True)
    else:
        failures = Path(tempfile.mkdtemp(prefix="ddiloco-ranks-"))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _forward(ranks, signum))
    try:
        for rank in range(nproc):
            device = devices[rank % len(devices)] if devices else None
            env = {**os.environ, **rank_env(rank, nproc, port, device), ENV_PREFIX + "RANK_FAILURES": str(failures)}
            ranks.append(subprocess.Popen(list(argv), env=env, preexec_fn=die_with_parent))
        atomic_write_json(failures / rank_failures.RANKS_FILE, {"ranks": [r.pid for r in ranks]}, durable=False)
        if pids_file is not None:
            atomic_write_json(pids_file, {"pid": os.getpid(), "master_port": port, "ranks": [r.pid for r in ranks]})
        return _wait(ranks, failures)
    finally:
        _stop(ranks)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(failures, ignore_errors=True)


def _forward(ranks: Sequence[subprocess.Popen], signum: int) -> None:
    """This process was signalled alone (the launcher's stop, which signals a Python child alone so that the workers
    of a rank's DataLoader are not killed under it, or its parent died): pass it on. A signal to the process group
    already reached every rank, and a rank's session takes a second SIGTERM like the first."""
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                rank.send_signal(signum)


def _wait(ranks: Sequence[subprocess.Popen], failures: Path) -> int:
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank = rank_failures.first_failed(failures, failed)
            code = codes[rank] if rank in failed else _exit_code(ranks[rank])
            if not code:  # the rank that failed first did not exit by itself, or exited 0: the first found is named
                rank = min(failed)
                code = codes[rank]
            logger.warning(FAILED_RANK, rank, ranks[rank].pid, exit_status(code))
            return code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def _exit_code(rank: subprocess.Popen) -> int | None:
    """The exit code of a rank that is failing by itself (an exception left its session), once it exits within
    `STOP_GRACE_S`; None if it does not."""
    try:
        return rank.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        return None


def _stop(ranks: Sequence[subprocess.Popen]) -> None:
    _forward(ranks, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
        rank.wait()


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddiloco.runtime.rank_group",
                                     description="Run one learner as N ranks with torchrun's environment.")
    parser.add_argument("--nproc", type=int, required=True, help="ranks of the learner")
    parser.add_argument("--devices", default="", help="torch devices dealt to the ranks round-robin (DDILOCO_DEVICE)")
    parser.add_argument("--pids-file", type=Path, default=None, help="write the ranks' pids here (JSON)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the learner's command")
    parsed = parser.parse_args(args)
    command = parsed.command[1:] if parsed.command[:1] == ["--"] else parsed.command
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    devices = [d for d in parsed.devices.split(",") if d]
    try:
        status = run_group(command, nproc=parsed.nproc, devices=devices, pids_file=parsed.pids_file)
    except ValueError as exc:
        print(f"rank_group: {exc}", file=sys.stderr)
        return 2
    if -status in _SIGNAL_DEATHS:
        _die_by(-status)
    return exit_status(status)


_SIGNAL_DEATHS = frozenset(int(s) for s in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT,
                                            signal.SIGILL, signal.SIGFPE))
"""Signals whose death of the rank that failed first the group dies of too, so that the supervisor sees what it sees of
a learner of one process: a signal's death, a fault that does not count towards giving the learner up (a kill -9, the
OOM killer, a crash in native code). Exiting 128 + N instead read as the script's own error: three kill -9s of a rank
in a row gave the learner up. Not SIGTERM or SIGINT: those stop a rank cleanly, and its exit says how."""


def _die_by(signum: int) -> None:
    """End this process by `signum` (its default action), as the rank that failed first ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    if signum != signal.SIGKILL:  # its handler cannot be set, nor needs to be
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank crashed, not this process: no core file of it
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal is delivered at once; never returns
    os._exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())

