"""`ddiloco run --resume DIR` starts each learner as the ranks and on the devices the run last ran with
(`launcher/command.json` records `--nproc-per-learner` and `--device` beside the learner command): a resume without
those flags used to start every learner of a `--nproc-per-learner 2` run as one process, without RANK, and each
crash-looped in `init_process_group`. A flag given on the resume is used, and the console says it differs; a run
recorded before the shape was is resumed as before (one process per learner, the flags given).

Real processes: the fake syncer of tests/fake_learners.py, `ddiloco.runtime.rank_group`, and a learner script that
notes how each of its starts was placed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.checkpoint import atomic_write_json
from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import FAST, run_parser

LEARNER = """
import json, os
with open("starts.jsonl", "a") as file:
    file.write(json.dumps({k: os.environ.get(k) for k in ("DDILOCO_LEARNER_ID", "RANK", "WORLD_SIZE",
                                                           "DDILOCO_DEVICE")}) + "\\n")
with open("checkpoint_every_s.txt", "a") as file:
    file.write(os.environ["DDILOCO_CHECKPOINT_EVERY_S"] + "\\n")
"""
"""A learner script (every rank of it) that notes its place and device and is done at once (exit status 0)."""
SCRIPT = ("python", "learner.py")


def run(fake_command: tuple[str, ...], *argv: str, script: tuple[str, ...] = ()) -> int:
    """`ddiloco run --learners 2 ARGV -- SCRIPT` with the fake syncer (the CLI cuts the script off at `--`)."""
    from ddiloco.runtime import run_commands

    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", "--threads", "1", *argv])
    args.script = list(script)
    return run_commands.run(args, command=fake_command, supervisor_config=FAST)


def placements(directory: Path) -> list[tuple[str, str | None, str | None, str | None]]:
    """(learner id, RANK, WORLD_SIZE, DDILOCO_DEVICE) of every start so far, sorted; the file is emptied."""
    path = directory / "starts.jsonl"
    found = sorted(tuple(json.loads(line).values()) for line in path.read_text().splitlines())
    path.write_text("")
    return found


@pytest.fixture
def ranked_run(tmp_path, fake_command, capsys, monkeypatch) -> Path:
    """A run of 2 learners x 2 ranks on cuda:0,cuda:1 that has finished (its script needs no GPU)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text(LEARNER)
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), "--nproc-per-learner", "2", "--device", "cuda:0,cuda:1",
               script=SCRIPT) == 0
    assert placements(tmp_path) == [(learner, str(rank), "2", f"cuda:{rank}") for learner in "01" for rank in range(2)]
    capsys.readouterr()
    return run_dir


def test_the_shape_is_recorded_and_a_resume_without_flags_runs_it_again_saying_so(ranked_run, fake_command, capsys):
    assert run(fake_command, "--resume", str(ranked_run)) == 0
    assert placements(ranked_run.parent) == [(learner, str(rank), "2", f"cuda:{rank}") for learner in "01"
                                             for rank in range(2)]
    out = capsys.readouterr().out
    assert "resuming with the run's --nproc-per-learner 2 --device cuda:0,cuda:1\n" in out, out
    record = json.loads(RunPaths(ranked_run).learner_command.read_text())
    assert (record["nproc_per_learner"], record["device"]) == (2, "cuda:0,cuda:1")


def test_a_flag_given_on_the_resume_is_used_and_said_to_differ(ranked_run, fake_command, capsys):
    assert run(fake_command, "--resume", str(ranked_run), "--nproc-per-learner", "1") == 0
    assert placements(ranked_run.parent) == [("0", None, None, "cuda:0"), ("1", None, None, "cuda:1")]
    out = capsys.readouterr().out
    assert ("resuming with --nproc-per-learner 1, which differs from what the run last ran with: "
            "--nproc-per-learner 2\n") in out, out
    assert "resuming with the run's --device cuda:0,cuda:1\n" in out, out
    # What the resume ran with is what the next resume runs.
    assert json.loads(RunPaths(ranked_run).learner_command.read_text())["nproc_per_learner"] == 1


def test_a_run_recorded_before_the_shape_resumes_as_before(ranked_run, fake_command, capsys):
    paths = RunPaths(ranked_run)
    atomic_write_json(paths.learner_command, {"command": list(SCRIPT), "cwd": str(ranked_run.parent)})
    assert run(fake_command, "--resume", str(ranked_run)) == 0
    assert placements(ranked_run.parent) == [("0", None, None, "cpu"), ("1", None, None, "cpu")]
    assert "--nproc-per-learner" not in capsys.readouterr().out


def test_round_files_all_reaches_the_syncer_and_a_plain_resume_keeps_it(tmp_path, fake_command, capsys, monkeypatch):
    """`--round-files all` (keep every round's tensors, for a replay from the genesis) is in the syncer's settings, and
    a `--resume` without the flag keeps it: with the default, the resumed syncer would remove early rounds' files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text(LEARNER)
    run_dir = tmp_path / "run"
    syncer_settings = RunPaths(run_dir).settings("syncer")
    assert run(fake_command, "--run-dir", str(run_dir), "--round-files", "all", "--full-state-every", "10",
               "--checkpoint-every-s", "2.5", script=SCRIPT) == 0
    kept = {"round_files": "all", "full_state_every": 10}
    assert {name: json.loads(syncer_settings.read_text())[name] for name in kept} == kept
    capsys.readouterr()
    syncer_settings.unlink()
    assert run(fake_command, "--resume", str(run_dir)) == 0
    assert ("resuming with the run's --round-files all --full-state-every 10 --checkpoint-every-s 2.5\n"
            in capsys.readouterr().out)
    assert {name: json.loads(syncer_settings.read_text())[name] for name in kept} == kept
    assert (tmp_path / "checkpoint_every_s.txt").read_text().split() == ["2.5"] * 4  # 2 learners, 2 starts each


def test_round_files_all_on_a_run_that_removed_its_early_rounds_files_says_a_replay_is_not_possible(tmp_path):
    from ddiloco.runtime.run_dir import pruned_rounds_note

    paths = RunPaths(tmp_path)
    (tmp_path / "rounds").mkdir()
    assert pruned_rounds_note(tmp_path) is None  # a new run: nothing removed
    paths.rounds.write_text('{"round": 0}\n')
    (tmp_path / "rounds" / "round_000000.safetensors").write_bytes(b"")
    assert pruned_rounds_note(tmp_path) is None  # every file from round 0 on
    (tmp_path / "rounds" / "round_000000.safetensors").unlink()
    (tmp_path / "rounds" / "round_000030.safetensors").write_bytes(b"")
    assert pruned_rounds_note(tmp_path) == (
        "--round-files all keeps every round's file from now on, but this run ran with --round-files recent before "
        "and removed the early ones (it holds from round_000030 on): a replay from the genesis is not possible")


def test_a_run_from_before_the_record_that_kept_every_rounds_file_keeps_them_on_a_plain_resume(tmp_path):
    # A run started before `launcher/command.json` recorded its launch shape kept every round's file (the versions of
    # then had no --round-files); a plain --resume by this version took today's default, `recent`, and deleted rounds
    # 0-11 and the first full state without a word: a replay from the genesis was no longer possible.
    from ddiloco.round_log import RoundLog
    from ddiloco.runtime.run_dir import LAUNCH_SHAPE, resumed_launch_shape
    from ddiloco.runtime.run_settings import RunSettings

    defaults = {name: getattr(RunSettings, name) for name in LAUNCH_SHAPE}
    log = RoundLog(tmp_path)
    log.path.parent.mkdir(parents=True, exist_ok=True)
    log.path.write_text('{"round": 0}\n')
    log.tensor_dir.mkdir(parents=True, exist_ok=True)
    log.tensors_path(0).write_bytes(b"round 0")
    kept, notes = resumed_launch_shape(tmp_path, {}, defaults)
    assert kept == {"round_files": "all"}
    assert notes == ("resuming with --round-files all: this run was started before ddiloco recorded its launch "
                     "settings, and it kept every round's file (give --round-files recent to keep only what a restart "
                     "needs)",)
    # Given on the resume, the flag is used as given; and a run whose early files are gone has nothing to keep.
    assert resumed_launch_shape(tmp_path, {"round_files": "recent"}, defaults) == ({}, ())
    log.tensors_path(0).unlink()
    assert resumed_launch_shape(tmp_path, {}, defaults) == ({}, ())


def test_a_plain_resume_keeps_the_runs_threads(tmp_path, fake_command, capsys, monkeypatch):
    # A run started with --threads 2 resumed with the default (cores // learners: 1 on this machine's 2 cores).
    from ddiloco.runtime import run_commands

    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text(
        'import os\nopen("threads.txt", "a").write(os.environ["DDILOCO_THREADS"] + "\\n")\n')
    run_dir = tmp_path / "run"

    def run_with(*argv: str) -> int:
        args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", *argv])
        args.script = list(SCRIPT)
        return run_commands.run(args, command=fake_command, supervisor_config=FAST)

    assert run_with("--run-dir", str(run_dir), "--threads", "2") == 0
    capsys.readouterr()
    assert run_with("--resume", str(run_dir)) == 0
    assert "resuming with the run's --threads 2\n" in capsys.readouterr().out
    assert (tmp_path / "threads.txt").read_text().split() == ["2"] * 4  # 2 learners, 2 starts each
