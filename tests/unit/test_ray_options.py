"""`ddiloco run --ray`: its flags, the missing-Ray error, the restart rules its actors follow, and the process
accounting that proves a local Ray instance left nothing behind. No Ray instance is started here
(tests/integration/test_ray_run.py starts one)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.runtime.launcher import LaunchConfig
from ddiloco.runtime.ray_actor import RoleSpec, restarts_after
from ddiloco.runtime.ray_cluster import descendants, still_running
from ddiloco.runtime.ray_options import RayOptions


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(["run", *argv])
    return code, capsys.readouterr().err


def test_ray_without_ray_installed_is_a_usage_error_naming_the_extra_and_writes_nothing(monkeypatch, capsys,
                                                                                         tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    run_dir = tmp_path / "run"
    code, err = run_cli(capsys, "--ray", "--run-dir", str(run_dir))
    assert code == 2
    assert "--ray needs Ray" in err and "pip install 'ray==2.58.0'" in err
    assert len(err.strip().splitlines()) == 1  # one line, no traceback
    assert not run_dir.exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (("--cpus-per-learner", "2"), "--cpus-per-learner only applies with --ray"),
    (("--gpus-per-learner", "1"), "--gpus-per-learner only applies with --ray"),
    (("--ray", "--cpus-per-learner", "-1"), "--cpus-per-learner -1.0 is invalid: expected a number >= 0"),
    (("--ray", "--gpus-per-learner", "nan"), "--gpus-per-learner nan is invalid"),
    (("--ray", "--standby-learners", "1"), "--standby-learners and --standby-syncer are for the local launcher"),
    (("--ray", "--standby-syncer"), "--standby-learners and --standby-syncer are for the local launcher"),
    (("--ray", "--gpus-per-learner", "1", "--device", "cuda:1"), "--device cuda:1 cannot be combined"),
])
def test_bad_ray_flags_are_refused_in_one_line_before_anything_is_written(capsys, tmp_path, argv, needle):
    run_dir = tmp_path / "run"
    code, err = run_cli(capsys, "--run-dir", str(run_dir), *argv)
    assert code == 2 and needle in err, err
    assert not run_dir.exists()


def test_ray_options_size_what_the_run_reserves():
    options = RayOptions(cpus_per_learner=1.5, gpus_per_learner=0.5)
    assert options.local and options.default_bind == "127.0.0.1:0"
    assert options.learner_threads == 2  # ceil(1.5)
    assert options.cpus_needed(num_learners=4, evaluator=True) == 1.0 + 5 * 1.5  # the syncer's CPU, then per actor
    assert options.gpus_needed(num_learners=4, evaluator=False) == 2.0
    assert RayOptions(address="auto").default_bind == "0.0.0.0:0"  # learners on other nodes dial the syncer
    assert RayOptions(cpus_per_learner=0.25).learner_threads == 1


@pytest.mark.parametrize(("role", "code", "restarted"), [
    ("learner", 0, False),        # done
    ("learner", 2, False),        # a usage error: a restart fails the same way
    ("learner", 3, False),        # refused by the syncer
    ("learner", 1, True),         # a crash
    ("learner", -signal.SIGKILL, True),
    ("learner", 4, True),         # its syncer never answered: on its way back
    ("evaluator", 0, False),
    ("evaluator", -signal.SIGKILL, True),
    ("syncer", 0, True),          # a syncer that ends by itself mid-run is brought back
    ("syncer", -signal.SIGKILL, True),
    ("syncer", 3, False),
    ("syncer", 2, False),
])
def test_an_actor_brings_back_exactly_what_the_local_supervisor_restarts(role, code, restarted):
    assert restarts_after(role, code) is restarted


def test_a_role_spec_needs_an_absolute_run_dir_and_a_known_role(tmp_path):
    launch = LaunchConfig(run_dir=Path("runs/x"), num_learners=1, threads=1)
    with pytest.raises(ValueError, match="absolute path"):
        RoleSpec(role="learner", name="learner-0", launch=launch, session="s")
    with pytest.raises(ValueError, match="role='trainer' is invalid"):
        RoleSpec(role="trainer", name="x", launch=LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1),
                 session="s")


def test_descendants_find_a_child_and_still_running_sees_it_go():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        seen = descendants(os.getpid())
        assert child.pid in seen
        assert still_running({child.pid: seen[child.pid]}) == [child.pid]
        assert still_running({child.pid: seen[child.pid] + 1}) == []  # same pid, another process: not it
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert still_running({child.pid: seen[child.pid]}) == []


def test_a_ray_address_nothing_listens_on_is_refused_before_anything_is_written(capsys, tmp_path):
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    code, err = run_cli(capsys, "--ray", f"127.0.0.1:{port}", "--run-dir", str(run_dir))
    assert code == 2 and f"--ray 127.0.0.1:{port}: no Ray cluster answers there" in err, err
    assert not run_dir.exists()
