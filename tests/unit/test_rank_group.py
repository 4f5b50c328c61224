"""`ddiloco.runtime.rank_group`: a learner's ranks started with torchrun's environment, failing fast as a group
(real processes; each rank a tiny Python script, no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ddiloco.runtime.launcher import LaunchConfig, Launcher, in_this_interpreter
from ddiloco.runtime.rank_group import exit_status, run_group

WRITE_ENV = ("import json, os, sys; keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', "
             "'MASTER_PORT', 'DDILOCO_DEVICE'); json.dump({k: os.environ.get(k) for k in keys}, "
             "open(sys.argv[1] + '/' + os.environ['RANK'], 'w'))")


def test_every_rank_gets_torchruns_environment_and_one_rendezvous_port(tmp_path):
    pids = tmp_path / "ranks.json"
    assert run_group([sys.executable, "-c", WRITE_ENV, str(tmp_path)], nproc=3, devices=["cuda:0", "cuda:1"],
                     pids_file=pids) == 0
    envs = [json.loads((tmp_path / str(rank)).read_text()) for rank in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["DDILOCO_DEVICE"]) for e in envs] == [
        ("0", "0", "cuda:0"), ("1", "1", "cuda:1"), ("2", "2", "cuda:0")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {("3", "3", "127.0.0.1")}
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) == json.loads(pids.read_text())["master_port"] > 0
    assert len(json.loads(pids.read_text())["ranks"]) == 3


def test_a_rank_killed_by_sigkill_stops_the_others_and_run_group_returns_its_signal(tmp_path):
    # Rank 1 kills itself; rank 0 would sleep for a minute: the group must not wait for it.
    script = ("import os, signal, time; os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGKILL); "
              "time.sleep(60)")
    assert run_group([sys.executable, "-c", script], nproc=2) == -signal.SIGKILL and exit_status(-9) == 137


@pytest.mark.parametrize(("fault", "status"), [
    (f"os.kill(os.getpid(), {int(signal.SIGKILL)})", -signal.SIGKILL),
    (f"os.kill(os.getpid(), {int(signal.SIGTERM)})", 143),
    ("sys.exit(137)", 137)])
def test_the_group_dies_of_the_signal_that_killed_its_first_rank_where_that_is_a_fault(tmp_path, fault, status):
    # As the supervisor sees a learner of one process: a kill -9 (the OOM killer) is a fault that does not count
    # towards giving the learner up. The group exited 137, an error of the script's own: three kill -9s of a rank in a
    # row gave the learner up. A SIGTERM stops a rank cleanly: its exit says how it went. A script that exits 137 by
    # itself was not killed: it is its own error, as it is for a learner of one process (the group died of SIGKILL).
    # Rank 1's fault waits for rank 0's print: under load rank 0 could start after rank 1 failed and be stopped first.
    printed = tmp_path / "printed"
    script = ("import os, pathlib, signal, sys, time; printed = pathlib.Path(sys.argv[1])\n"
              "if os.environ['RANK'] == '0': print(os.environ['DDILOCO_RANK_FAILURES'], flush=True); printed.touch()\n"
              "else:\n    deadline = time.monotonic() + 50\n"
              "    while not printed.exists() and time.monotonic() < deadline: time.sleep(0.01)\n"
              f"    {fault}\n"
              "time.sleep(60)")
    pids = tmp_path / "learner" / "ranks.json"
    pids.parent.mkdir()
    done = subprocess.run([sys.executable, "-m", "ddiloco.runtime.rank_group", "--nproc", "2", "--pids-file",
                           str(pids), "--", sys.executable, "-c", script, str(printed)],
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == status, done.stderr
    assert "rank 1 (pid" in done.stderr
    # The ranks record their failures beside the pids, not in /tmp (a SIGKILLed group left a folder there each time),
    # and the folder goes with the group.
    assert done.stdout.split() == [str(pids.parent / "rank_failures")]
    assert not (pids.parent / "rank_failures").exists()


@pytest.mark.parametrize("status", [3, 2, 1])
def test_a_ranks_exit_status_passes_through(status):
    script = f"import os, sys, time; os.environ['RANK'] == '1' and sys.exit({status}); time.sleep(60)"
    assert run_group([sys.executable, "-c", script], nproc=2) == status


def test_the_launcher_wraps_a_script_of_several_ranks_and_deals_devices_per_rank(tmp_path):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=2, threads=1, script=("python", "train.py"),
                                     nproc_per_learner=2, devices=("cuda:0", "cuda:1", "cuda:2"), use_token=False))
    argv = launcher.learner_argv(1, "127.0.0.1:5")
    # A bare `python` is the interpreter ddiloco runs in (the venv's), whatever `python` the PATH finds.
    assert argv[1:3] == ["-m", "ddiloco.runtime.rank_group"] and argv[-3:] == ["--", sys.executable, "train.py"]
    assert argv[argv.index("--nproc") + 1] == "2" and argv[argv.index("--devices") + 1] == "cuda:2,cuda:0"
    with pytest.raises(ValueError, match="nproc_per_learner=2 needs a learner script"):
        LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, nproc_per_learner=2)
    with pytest.raises(ValueError, match="nproc_per_learner=0 is invalid"):
        LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, script=("x",), nproc_per_learner=0)


@pytest.mark.parametrize("script, expected", [
    (["python", "train.py", "--lr", "1"], [sys.executable, "train.py", "--lr", "1"]),
    (["python3", "-u", "train.py"], [sys.executable, "-u", "train.py"]),
    (["/opt/env/bin/python", "train.py"], ["/opt/env/bin/python", "train.py"]),  # a path: the user's choice
    (["./train.sh", "python"], ["./train.sh", "python"]),
])
def test_a_bare_python_runs_the_script_in_ddilocos_own_interpreter(tmp_path, script, expected):
    assert in_this_interpreter(script) == expected
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, script=tuple(script),
                                     use_token=False))
    assert launcher.learner_argv(0, "127.0.0.1:5") == expected == launcher.evaluator_argv("127.0.0.1:5")


RAISES_THEN_EXITS_LATE = '''
import os, sys, time
from pathlib import Path
from ddiloco import rank_failures
from ddiloco.environment import environment

env, raised = environment(), Path(sys.argv[1]) / "raised"
failures = Path(os.environ.get("DDILOCO_RANK_FAILURES", sys.argv[1]))
if env.rank == 0:
    raised.touch()  # its exception is on its way out of the session: the other rank fails in a collective with it
    rank_failures.record(failures, env.rank)
    time.sleep(1.0)  # printing its traceback, tearing its interpreter down
    sys.exit(7)
deadline = time.monotonic() + 30
while not raised.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(1)  # its collective failed: it exits at once, before rank 0
'''


def test_the_rank_that_raised_first_is_named_although_another_exited_before_it(tmp_path, caplog):
    caplog.set_level("WARNING", logger="ddiloco.runtime.rank_group")
    assert run_group([sys.executable, "-c", RAISES_THEN_EXITS_LATE, str(tmp_path)], nproc=2) == 7
    assert [record.args[0] for record in caplog.records] == [0]


KILLED_THEN_A_PEER_FAILS = '''
import os, signal, sys, time
from pathlib import Path
from ddiloco import rank_failures
from ddiloco.checkpoint import read_json_object
from ddiloco.environment import environment

env, failures = environment(), Path(os.environ["DDILOCO_RANK_FAILURES"])
if env.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:  # until the killed rank is gone: then its collective with it fails
    pids = (read_json_object(failures / rank_failures.RANKS_FILE) or {}).get("ranks")
    if pids and not rank_failures._alive(pids[1]):
        break
    time.sleep(0.01)
rank_failures.record(failures, env.rank)
sys.exit(5)  # at once: the group may find both ranks exited at one look
'''


def test_a_rank_killed_by_a_signal_is_named_before_a_rank_that_failed_after_its_death(caplog):
    caplog.set_level("WARNING", logger="ddiloco.runtime.rank_group")
    assert run_group([sys.executable, "-c", KILLED_THEN_A_PEER_FAILS], nproc=2) == -signal.SIGKILL
    assert [record.args[0] for record in caplog.records] == [1]


WORLD_OF_ONE = """
import os, torch, torch.distributed as dist
from torch import nn
import ddiloco
os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)  # each rank a group of its own
model = nn.Linear(2, 2)
try:
    ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), syncer="127.0.0.1:1")
except ValueError as exc:
    print(exc)
"""


def test_a_process_group_of_another_size_than_the_learners_ranks_is_refused_naming_both():
    # Each rank of a --nproc-per-learner 2 learner made a group of one: both joined as the whole learner, one was
    # refused as "a second process" of it, and the run's reason for it was the other rank's last line of output.
    from ddiloco.runtime.rank_group import free_port

    done = subprocess.run([sys.executable, "-c", WORLD_OF_ONE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PORT": str(free_port())})
    assert done.stdout.strip() == (
        "this learner has 2 ranks (WORLD_SIZE, --nproc-per-learner), but the process group holds 1: let "
        "init_process_group read them from the environment (dist.init_process_group('gloo'), no rank= or "
        "world_size=), or pass group= the learner's ranks"), done.stderr[-2000:]
