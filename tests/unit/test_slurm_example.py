"""examples/slurm/: the sbatch recipe parses (and passes shellcheck where it is installed), and its restart
loop brings a process back exactly when `ddiloco run`'s supervisor would (docs/clusters.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SLURM = Path(__file__).parents[2] / "examples" / "slurm"
SCRIPTS = [SLURM / "ddiloco.sbatch", SLURM / "restart.sh"]
TIMEOUT_S = 60


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_slurm_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=TIMEOUT_S)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_slurm_scripts_pass_shellcheck(script):
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout


def restart(role: str, command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SLURM / "restart.sh"), role, "bash", "-c", command], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("code", [2, 3])
def test_a_usage_error_or_a_refusal_is_not_restarted(tmp_path, code):
    result = restart("learner", f"echo run >> runs; exit {code}", tmp_path)
    assert result.returncode == code
    assert (tmp_path / "runs").read_text().count("run") == 1


def test_a_crashed_learner_is_restarted_until_it_is_done(tmp_path):
    # The first run is killed (SIGKILL, as by kill -9), the second finishes.
    result = restart("learner", "echo run >> runs; [ $(wc -l < runs) -ge 2 ] || kill -9 $$", tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs").read_text().count("run") == 2
    assert "learner exited with 137" in result.stderr and "restarting in 1 s" in result.stderr


def test_a_syncer_that_exits_0_by_itself_is_restarted(tmp_path):
    result = restart("syncer", "echo run >> runs; [ $(wc -l < runs) -ge 2 ] && exit 3; exit 0", tmp_path)
    assert result.returncode == 3
    assert (tmp_path / "runs").read_text().count("run") == 2


@pytest.mark.parametrize("where", ["flags", "environment"])
def test_a_learner_stopped_before_its_budget_by_a_sigterm_from_elsewhere_is_restarted(tmp_path, where):
    # Such a learner (a preemption, a `kill` of the learner alone) exits 0 as a finished one does; only its
    # status.json tells the two apart (`ddiloco run` reads it). restart.sh took the exit 0 for done and ended.
    status = tmp_path / "run" / "learners" / "1" / "status.json"
    status.parent.mkdir(parents=True)
    command = ("echo run >> runs; if [ $(wc -l < runs) -lt 2 ]; then state=stopped; else state=done; fi; "
               f"printf '{{\"state\": \"%s\", \"inner_step\": 7}}' $state > {status}; exit 0")
    where_args = ["_", "--run-dir", str(tmp_path / "run"), "--learner-id", "1"] if where == "flags" else []
    env = {"DDILOCO_RUN_DIR": str(tmp_path / "run"), "DDILOCO_LEARNER_ID": "1"} if where == "environment" else {}
    result = subprocess.run([str(SLURM / "restart.sh"), "learner", "bash", "-c", command, *where_args],
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={"PATH": "/usr/bin:/bin", **env})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs").read_text().count("run") == 2  # stopped: restarted; done: not
    assert "stopped before its budget" in result.stderr, result.stderr
