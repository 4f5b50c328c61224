"""A user's mistakes, met as a user meets them: real `ddiloco` processes with a bad config file, a bad
path, a read-only run directory, a `--resume` that would change the run, a wrong syncer address, and
Ctrl-C while everything is still starting.

Each ends with one line that says what is wrong (never a traceback) and the exit code the CLI uses for
it: 2 for bad input (flags, config, paths), 4 for a syncer that never answered, 130 for Ctrl-C; and
nothing is left running or half-written. Every wait has a hard deadline; every process is killed by PID.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.data import DataConfig
from ddiloco.model import ModelConfig
from ddiloco.run_config import RunConfig
from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import PROCESS_WAIT_S, TINY_MODEL_FLAGS, wait_until

pytestmark = pytest.mark.integration

EXIT_USAGE = 2
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130
TINY_RUN = RunConfig(model=ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32),
                     data=DataConfig(context_len=32, batch_size=4), num_learners=3, inner_steps=8)


def ddiloco(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python -m ddiloco.cli ARGS` in its own session (a signal sent to it reaches only it), output merged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *python_flags, "-m", "ddiloco.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def finish(popen: subprocess.Popen) -> str:
    """Its whole output once it exits; never leaves it (or its process group) running."""
    try:
        return popen.communicate(timeout=PROCESS_WAIT_S)[0]
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()


def refused_with(out: str, code: int, popen: subprocess.Popen, *needles: str) -> None:
    assert popen.returncode == code, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, out


def run_usage_error(*args: str) -> str:
    popen = ddiloco("run", "--no-progress", *args)
    out = finish(popen)
    refused_with(out, EXIT_USAGE, popen, "ddiloco run: error:")
    return out


# ---- the config file --------------------------------------------------------------------------------------

def test_a_config_value_of_the_wrong_type_is_refused_naming_the_field(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"inner": {"lr": "1e-3"}}))
    run_dir = tmp_path / "run"
    out = run_usage_error("--config", str(config), "--run-dir", str(run_dir))
    assert 'inner.lr = "1e-3"' in out and "expected a number" in out and str(config) in out
    assert not run_dir.exists()  # refused before anything was written


def test_a_config_that_is_a_directory_is_refused(tmp_path):
    out = run_usage_error("--config", str(tmp_path), "--run-dir", str(tmp_path / "run"))
    assert f"run config {tmp_path} is a directory" in out


# ---- the run directory ------------------------------------------------------------------------------------

def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a run\n")
    out = run_usage_error("--run-dir", str(afile), *TINY_MODEL_FLAGS)
    assert f"--run-dir {afile} is a file, not a directory" in out
    assert afile.read_text() == "not a run\n"


@pytest.fixture
def read_only(tmp_path):
    """`make(path, files)`: a directory holding `files` ({name: bytes}) that nobody may write to: mode 0555, or
    (as root, whom modes do not stop) a read-only tmpfs mount. Skips where neither is possible."""
    mounted: list[Path] = []
    chmodded: list[Path] = []

    def make(path: Path, files: dict[str, bytes]) -> Path:
        path.mkdir(parents=True)
        if os.geteuid() != 0:
            for name, data in files.items():
                (path / name).write_bytes(data)
            path.chmod(0o555)
            chmodded.append(path)
            return path
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): root ignores file modes")
        mounted.append(path)
        for name, data in files.items():
            (path / name).write_bytes(data)
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        return path

    try:
        yield make
    finally:
        for path in mounted:
            subprocess.run(["umount", str(path)], check=False)
        for path in chmodded:
            path.chmod(0o755)


def test_a_read_only_run_dir_is_refused_before_any_process_starts(tmp_path, read_only):
    fresh = read_only(tmp_path / "fresh", {})
    out = run_usage_error("--run-dir", str(fresh), *TINY_MODEL_FLAGS)
    assert f"run directory {fresh} is not writable" in out and "started" not in out

    config = json.dumps(TINY_RUN.to_dict()).encode()
    stopped = read_only(tmp_path / "stopped", {"config.json": config})
    out = run_usage_error("--resume", str(stopped))
    assert f"run directory {stopped} is not writable" in out and "started" not in out
    assert (stopped / "config.json").read_bytes() == config


# ---- --resume ---------------------------------------------------------------------------------------------

def test_resume_refuses_settings_a_run_cannot_change_and_leaves_its_config_untouched(tmp_path):
    from ddiloco.runtime.syncer_state import GenesisRecord, write_genesis
    from ddiloco.train_tinygpt import initial_params

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    TINY_RUN.save(run_dir / "config.json")
    write_genesis(run_dir, GenesisRecord(initial_params(TINY_RUN), (), "a test"))  # made with these settings
    before = (run_dir / "config.json").read_bytes()
    out = run_usage_error("--resume", str(run_dir), "--learners", "5", "--model-width", "64", "--inner-steps", "99")
    assert "--learners 5 (the run has 3)" in out and "--model-width 64 (the run has 32)" in out
    assert "--inner-steps 99" not in out  # a budget may change
    assert (run_dir / "config.json").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "genesis.safetensors"]  # nothing written


# ---- a learner given a wrong syncer address ----------------------------------------------------------------

def closed_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_learner_that_cannot_reach_its_syncer_says_so_and_gives_up(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    run_dir = tmp_path / "run"
    popen = ddiloco("-v", "learner", "--syncer", address, "--learner-id", "0", "--run-dir", str(run_dir),
                    "--learners", "1", "--threads", "1", "--connect-timeout-s", "4", *TINY_MODEL_FLAGS)
    out = finish(popen)
    refused_with(out, EXIT_UNREACHABLE, popen, f"ddiloco learner: cannot reach the syncer at {address}",
                 "--connect-timeout-s")
    warnings = [line for line in out.splitlines() if re.search(r" W .*cannot reach the syncer at", line)]
    assert len(warnings) == 1 and address in warnings[0] and "UNAVAILABLE" in warnings[0], out
    status = read_json_object(RunPaths(run_dir).learner_status(0)) or {}
    assert status.get("state") == "unreachable"


# ---- Ctrl-C while everything starts -----------------------------------------------------------------------

def interrupted(popen: subprocess.Popen) -> str:
    popen.send_signal(signal.SIGINT)
    out = finish(popen)
    refused_with(out, EXIT_INTERRUPTED, popen)
    return out


@pytest.mark.timeout(300)
def test_ctrl_c_while_importing_exits_130_without_a_traceback(tmp_path):
    # -X importtime reports each module as it finishes: the first torch submodule means torch is being imported.
    popen = ddiloco("run", "--no-progress", "--run-dir", str(tmp_path / "run"), *TINY_MODEL_FLAGS,
                    python_flags=("-X", "importtime"))
    seen = []
    assert popen.stdout is not None
    for line in popen.stdout:
        seen.append(line)
        if re.search(r"\|\s+torch\.", line):
            break
    else:
        pytest.fail("the process ended before it imported torch:\n" + "".join(seen))
    out = "".join(seen) + interrupted(popen)
    assert "interrupted" in out.splitlines()[-1]


SWALLOWED_CTRL_C = """
import os, signal, sys
import {module} as target
from ddiloco.cli import main

real = target.{name}

def swallowing(*args, **kwargs):
    # What an optional import guarded by a bare `except:` does to a Ctrl-C that lands inside it.
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):  # the handler runs at the next bytecode boundary
            pass
    except:  # noqa: E722
        pass
    return real(*args, **kwargs)

target.{name} = swallowing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("module", "name"), [("ddiloco.cli", "build_parser"),
                                              ("ddiloco.runtime.supervisor", "Supervisor")])
def test_a_ctrl_c_that_an_import_swallows_still_stops_the_run(tmp_path, module, name):
    # A CI run once saw `ddiloco run` train to its end after a Ctrl-C sent while it imported torch: the
    # KeyboardInterrupt was lost inside an import. Swallowed while the parser's imports run, or after them but before
    # `ddiloco run` has its own handlers (the supervisor is built just before), the Ctrl-C still ends it with 130
    # before any training.
    run_dir = tmp_path / "run"
    code = SWALLOWED_CTRL_C.format(module=module, name=name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen([sys.executable, "-c", code, "run", "--no-progress", "--run-dir", str(run_dir),
                              *TINY_MODEL_FLAGS, "--learners", "1", "--inner-steps", "1000000"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
    out = finish(popen)
    refused_with(out, EXIT_INTERRUPTED, popen)
    assert "interrupted" in out, out
    summary = read_json_object(RunPaths(run_dir).summary) or {}
    assert summary.get("outcome") in (None, "interrupted"), summary  # stopped before it trained, if it started
    assert not any(learner.get("inner_step") for learner in summary.get("learners", {}).values()), summary


def started_pids(run_dir: Path) -> dict[str, list[int]]:
    return (read_json_object(RunPaths(run_dir).processes) or {}).get("children", {})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["syncer", "learner-0"])
def test_ctrl_c_while_the_processes_start_stops_all_of_them(tmp_path, phase):
    run_dir = tmp_path / "run"
    popen = ddiloco("run", "--no-progress", "--run-dir", str(run_dir), *TINY_MODEL_FLAGS, "--learners", "2",
                    "--threads", "1", "--inner-steps", "1000000")
    try:
        # Signalled as soon as that process has been started, while it is still importing torch.
        wait_until(lambda: phase in started_pids(run_dir), f"{phase} started", alive=[popen])
    except BaseException:
        finish(popen)
        raise
    interrupted(popen)
    pids = [pid for group in started_pids(run_dir).values() for pid in group]
    assert pids and not [pid for pid in pids if process_group_alive(pid)]
    for log in RunPaths(run_dir).logs.glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log

