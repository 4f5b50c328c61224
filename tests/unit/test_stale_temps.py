"""Files a process killed while writing left (`.NAME.PID.tmp`, `checkpoint.atomic_write_bytes`) are removed: by the
next state saved in their directory, and by a syncer's restore from its run directory (the round files, its states, its
status). A probe (kill -9 of the writer the moment its temporary file appeared) left six, each as large as what was
being written, through every later save and four `--resume`s (until 2026-12-07). A live process's are its writes in
flight and stay.
"""

import os
import subprocess
import sys

import torch

from ddiloco.checkpoint import remove_stale_temps, save_state, state_files
from ddiloco.config import QuorumConfig
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of, single_fragment


def dead_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def leftovers(directory, pid: int, *names: str) -> list:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f".{name}.{pid}.tmp" for name in names]
    for path in paths:
        path.write_bytes(b"half of a state")
    return paths


def test_a_state_saved_removes_what_a_killed_writer_left_and_keeps_a_live_ones(tmp_path):
    killed = leftovers(tmp_path, dead_pid(), "state_000000004.safetensors", "state_000000004.json")
    in_flight = leftovers(tmp_path, os.getpid(), "state_000000009.safetensors")
    other = tmp_path / "notes.tmp"
    other.write_text("not a file of ours")
    save_state(tmp_path, {"w": torch.ones(3)}, serial=5)
    assert not any(path.exists() for path in killed)
    assert all(path.exists() for path in in_flight) and other.exists()
    assert [serial for serial, _ in state_files(tmp_path)] == [5]


def test_a_restored_syncer_removes_what_its_killed_predecessor_left(tmp_path):
    pid = dead_pid()
    killed = (leftovers(tmp_path / "rounds", pid, "round_000031.safetensors")
              + leftovers(tmp_path, pid, "syncer_status.json"))
    store = SyncerStore(tmp_path)
    killed += leftovers(store.state_dir, pid, "state_000000030.safetensors")
    config = single_fragment()
    store.restore(Syncer(config, QuorumConfig(), initial_params=params_of(TinyNet(seed=1))))
    assert [path.name for path in killed if path.exists()] == []


def test_nothing_to_remove_is_no_error(tmp_path):
    assert remove_stale_temps(tmp_path / "absent") == []
    assert remove_stale_temps(tmp_path) == []
