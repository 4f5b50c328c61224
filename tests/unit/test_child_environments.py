"""A `ddiloco run` started inside a torchrun or SLURM job does not hand that job's torch.distributed variables to
its children: each learner of one process used to inherit RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so every
session set up a process group on the same port (EADDRINUSE for one, a hang for the other). A learner of several
ranks gets only the rank group's own (`rank_group.rank_env`), none of the outer job's leftovers.

Real processes: the fake syncer of tests/fake_learners.py, `ddiloco.runtime.rank_group`, and a learner script that
writes its environment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddiloco.runtime.launcher import LaunchConfig, Launcher
from tests.fake_learners import FAST, run_parser

OUTER_JOB = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
             "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571", "TORCHELASTIC_RUN_ID": "job",
             "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
"""What torchrun gives each of its workers: here, the environment `ddiloco run` itself was started in."""
KEPT = {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "0,1"}
"""The outer job's other variables, which say nothing about a process group and stay."""
LEARNER = """
import json, os, time
role = os.environ["DDILOCO_ROLE"]
name = role + "-" + os.environ["DDILOCO_LEARNER_ID"] + "-" + os.environ.get("RANK", "none")
with open(name + ".tmp", "w") as file:
    json.dump(dict(os.environ), file)
os.replace(name + ".tmp", name + ".json")
deadline = time.monotonic() + 30
while role == "learner" and os.path.exists("evaluator.expected") and not os.path.exists("evaluator-0-none.json") \
        and time.monotonic() < deadline:
    time.sleep(0.01)  # the run stops its evaluator once the learners are done: it writes first
"""
"""A learner script (every rank of it, and the evaluator) that writes its environment and is done at once (a
learner once the evaluator has written its own, where one is expected)."""


@pytest.fixture
def in_a_torchrun_job(monkeypatch) -> None:
    for name, value in {**OUTER_JOB, **KEPT}.items():
        monkeypatch.setenv(name, value)


def run_script(fake_command: tuple[str, ...], directory: Path, *argv: str) -> dict[str, dict[str, str]]:
    """`ddiloco run --learners 2 ARGV -- python learner.py` with the fake syncer: each start's environment, by
    `ROLE-LEARNER-RANK`."""
    from ddiloco.runtime import run_commands

    (directory / "learner.py").write_text(LEARNER)
    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", "--threads", "1", "--run-dir",
                                    str(directory / "run"), *argv])
    args.script = ["python", "learner.py"]
    assert run_commands.run(args, command=fake_command, supervisor_config=FAST) == 0
    return {path.stem: json.loads(path.read_text()) for path in directory.glob("*.json")}


def torch_distributed(env: dict[str, str]) -> dict[str, str]:
    return {name: env[name] for name in OUTER_JOB if name in env}


def test_a_child_started_by_the_launcher_leaves_the_outer_jobs_process_group_behind(tmp_path, in_a_torchrun_job):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False))
    out = tmp_path / "env.json"
    child = launcher.start("learner-0", [sys.executable, "-c", f"import json, os; json.dump(dict(os.environ), "
                                                              f"open({str(out)!r}, 'w'))"], 1,
                           env_extra={"DDILOCO_LEARNER_ID": "0"})
    assert child.popen.wait(timeout=30) == 0
    env = json.loads(out.read_text())
    assert torch_distributed(env) == {}
    assert {name: env.get(name) for name in KEPT} == KEPT
    assert env["DDILOCO_LEARNER_ID"] == "0"


def test_learners_of_one_process_and_the_evaluator_get_no_torch_distributed_variables(
        tmp_path, fake_command, in_a_torchrun_job, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evaluator.expected").touch()
    envs = run_script(fake_command, tmp_path, "--evaluate")
    assert sorted(envs) == ["evaluator-0-none", "learner-0-none", "learner-1-none"]
    assert {name: torch_distributed(env) for name, env in envs.items()} == {name: {} for name in envs}
    assert all({name: env.get(name) for name in KEPT} == KEPT for env in envs.values())


def test_ranks_of_a_learner_get_their_own_group_and_none_of_the_outer_jobs(
        tmp_path, fake_command, in_a_torchrun_job, monkeypatch):
    monkeypatch.chdir(tmp_path)
    envs = run_script(fake_command, tmp_path, "--nproc-per-learner", "2")
    assert sorted(envs) == ["learner-0-0", "learner-0-1", "learner-1-0", "learner-1-1"]
    for name, env in envs.items():
        rank = name.rsplit("-", 1)[1]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == (rank, rank, "2",
                                                                                          "127.0.0.1"), name
        assert env["MASTER_PORT"] != OUTER_JOB["MASTER_PORT"]
        # The outer job's agent store and run id would point the rank group's rendezvous at torchrun's agent.
        assert "TORCHELASTIC_USE_AGENT_STORE" not in env and "TORCHELASTIC_RUN_ID" not in env, name
        assert "GROUP_WORLD_SIZE" not in env, name
    ports = {env["MASTER_PORT"] for env in envs.values()}
    assert len(ports) == 2  # one rendezvous per learner
