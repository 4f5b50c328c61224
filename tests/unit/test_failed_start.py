"""A `ddiloco run` whose start fails before any of its processes ran leaves the run directory as it found it.

Ray that could not be started or joined left config.json, launcher/, logs/ and token behind, so the same command
again was refused ("already exists and is not empty: use --resume"); a `--resume` whose start failed left its
changed config.json and a session that never ran in the launcher's metrics. What this start created goes, what was
there stays.

The Ray case fails in `RayCluster.start` (no cluster needed); the local one runs a syncer command that does not exist.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import FAST, run_parser

JOIN_ERROR = "--ray auto: cannot join the Ray cluster: Could not find any running Ray instance"


def run(command: tuple[str, ...], *argv: str) -> int:
    from ddiloco.runtime import run_commands

    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", "--threads", "1", *argv])
    args.script = []
    return run_commands.run(args, command=command, supervisor_config=FAST)


def contents(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory`, with each file's bytes (None for a directory)."""
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in directory.rglob("*")}


@pytest.fixture
def ray_cannot_start(monkeypatch):
    pytest.importorskip("ray")
    from ddiloco.runtime.ray_cluster import RayCluster

    def refuse(self, *, cpus_needed: float) -> str:
        raise ValueError(JOIN_ERROR)

    monkeypatch.setattr(RayCluster, "start", refuse)


def test_a_new_run_whose_ray_cannot_start_leaves_no_directory_and_runs_again(tmp_path, fake_command,
                                                                            ray_cannot_start):
    run_dir = tmp_path / "new" / "run"
    for _ in range(2):  # the same command again fails the same way, not with "already exists ... use --resume"
        with pytest.raises(ValueError, match=JOIN_ERROR):
            run(fake_command, "--ray", "auto", "--inner-steps", "50", "--run-dir", str(run_dir))
        assert not (tmp_path / "new").exists(), contents(tmp_path / "new")


def test_an_empty_run_directory_given_stays_and_stays_empty(tmp_path, fake_command, ray_cannot_start):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ValueError, match=JOIN_ERROR):
        run(fake_command, "--ray", "auto", "--inner-steps", "50", "--run-dir", str(run_dir))
    assert run_dir.is_dir() and contents(run_dir) == {}


def test_a_resume_whose_start_fails_leaves_the_run_as_it_was(tmp_path, fake_command, ray_cannot_start):
    run_dir = tmp_path / "run"
    assert run(fake_command, "--inner-steps", "50", "--run-dir", str(run_dir)) == 0
    before = contents(run_dir)
    with pytest.raises(ValueError, match=JOIN_ERROR):
        run(fake_command, "--ray", "auto", "--resume", str(run_dir), "--inner-steps", "80")
    assert contents(run_dir) == before


def test_a_local_start_that_cannot_start_its_syncer_leaves_no_directory(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(FileNotFoundError):
        run((str(tmp_path / "no-such-ddiloco"),), "--inner-steps", "50", "--run-dir", str(run_dir))
    assert not run_dir.exists(), contents(run_dir)


def test_a_start_that_ran_a_process_keeps_its_directory_and_says_how_to_retry(tmp_path, fake_command, monkeypatch,
                                                                             capsys):
    """A syncer that ran and failed (here: at once, as one that cannot bind its `--bind` port does) leaves its log and
    the run's records, which say why; the same command again is refused (the directory is not empty), so the console
    says the one that retries."""
    monkeypatch.setenv("FAKE_PLAN", '{"syncer": {"exit_code": 2, "message": "address already in use"}}')
    run_dir = tmp_path / "run"
    assert run(fake_command, "--inner-steps", "50", "--run-dir", str(run_dir)) == 1
    assert "address already in use" in RunPaths(run_dir).log("syncer").read_text()
    assert (run_dir / "config.json").is_file()
    assert f"retry it with: ddiloco run --resume {run_dir}\n" in capsys.readouterr().out


def test_joining_no_cluster_says_how_to_get_one_in_ddiloco_s_own_flags(monkeypatch):
    # Ray's own advice named `--address`, a flag of `ray`'s CLI that `ddiloco run` has not.
    pytest.importorskip("ray")
    from ddiloco.runtime.ray_cluster import RayCluster
    from ddiloco.runtime.ray_options import RayOptions

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError) as refused:
        RayCluster(RayOptions(address="auto")).start(cpus_needed=1)
    message = str(refused.value)
    assert message.startswith(JOIN_ERROR) and "--address" not in message, message
    assert "ray start --head" in message and "--ray HOST:PORT" in message, message


def test_the_retry_command_quotes_a_run_directory_with_spaces(tmp_path, fake_command, monkeypatch, capsys):
    # `ddiloco run --resume sp ace/rün ☃`, pasted as printed, named three paths.
    monkeypatch.setenv("FAKE_PLAN", '{"syncer": {"exit_code": 2, "message": "address already in use"}}')
    run_dir = tmp_path / "sp ace" / "rün ☃"
    assert run(fake_command, "--inner-steps", "50", "--run-dir", str(run_dir)) == 1
    assert f"retry it with: ddiloco run --resume {shlex.quote(str(run_dir))}\n" in capsys.readouterr().out
