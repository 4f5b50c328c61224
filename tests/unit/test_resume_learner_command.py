"""A run records its learner command (`launcher/command.json`), and `ddiloco run --resume DIR` without `-- COMMAND`
runs it again, saying so; one given that differs is used, and that is said too. A run from before the record existed
is resumed as before, unless its genesis shows a script's model: then a resume without `-- COMMAND` is refused
instead of starting the built-in TinyGPT, which the syncer would refuse with a misleading error.

Real processes: the fake syncer of tests/fake_learners.py and a learner script that notes how it was started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ddiloco.cli import main
from ddiloco.data import DataConfig
from ddiloco.model import ModelConfig, build_model
from ddiloco.run_config import RunConfig
from ddiloco.runtime.run_dir import resumed_learner_command
from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import FAST, run_parser

EXIT_USAGE = 2
LEARNER = """
import json, os, sys
with open("starts.jsonl", "a") as file:
    file.write(json.dumps({"learner_id": os.environ["DDILOCO_LEARNER_ID"], "argv": sys.argv[1:]}) + "\\n")
"""
"""A learner script that notes its arguments and is done at once (exit status 0)."""


def run(fake_command: tuple[str, ...], *argv: str, script: tuple[str, ...] = ()) -> int:
    """`ddiloco run --learners 2 ARGV -- SCRIPT` with the fake syncer (the CLI cuts the script off at `--`)."""
    from ddiloco.runtime import run_commands

    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", *argv])
    args.script = list(script)
    return run_commands.run(args, command=fake_command, supervisor_config=FAST)


def starts(directory: Path) -> list[list[str]]:
    """The arguments of every learner start so far, in order."""
    return [json.loads(line)["argv"] for line in (directory / "starts.jsonl").read_text().splitlines()]


def test_resume_without_a_command_runs_the_runs_own_and_one_that_differs_is_used_and_named(
        tmp_path, fake_command, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text(LEARNER)
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), script=("python", "learner.py", "first")) == 0
    assert json.loads(RunPaths(run_dir).learner_command.read_text()) == {"command": ["python", "learner.py", "first"],
                                                                          "cwd": str(tmp_path), "nproc_per_learner": 1,
                                                                          "device": "cpu", "threads": None,
                                                                          "evaluate": False,
                                                                          "round_files": "recent",
                                                                          "full_state_every": 100,
                                                                          "checkpoint_every_s": 10.0}
    capsys.readouterr()

    assert run(fake_command, "--resume", str(run_dir)) == 0
    assert "resuming with the run's command: python learner.py first\n" in capsys.readouterr().out
    assert starts(tmp_path) == [["first"]] * 4

    assert run(fake_command, "--resume", str(run_dir), script=("python", "learner.py", "second")) == 0
    assert ("resuming with python learner.py second, which differs from the command the run last ran with: python "
            "learner.py first\n") in capsys.readouterr().out
    assert starts(tmp_path)[4:] == [["second"]] * 2
    assert json.loads(RunPaths(run_dir).learner_command.read_text())["command"] == ["python", "learner.py", "second"]


def test_the_built_in_learner_is_recorded_as_no_command(tmp_path, fake_command, capsys):
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), "--inner-steps", "5") == 0
    assert json.loads(RunPaths(run_dir).learner_command.read_text())["command"] == []
    assert resumed_learner_command(run_dir, RunConfig.load(run_dir / "config.json"), ()) == ((), None)
    assert resumed_learner_command(run_dir, RunConfig.load(run_dir / "config.json"), ("python", "t.py"))[1] == (
        "resuming with python t.py, which differs from the command the run last ran with: the built-in TinyGPT "
        "learner")


TINY = RunConfig(model=ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32),
                 data=DataConfig(context_len=32, batch_size=4))


def unrecorded_run(tmp_path: Path, genesis: dict[str, torch.Tensor] | None) -> Path:
    """A run directory as written before learner commands were recorded, with this genesis."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    TINY.save(run_dir / "config.json")
    if genesis is not None:
        save_file(genesis, run_dir / "genesis.safetensors")
    return run_dir


def test_an_unrecorded_script_run_is_refused_without_a_command_and_left_as_it_was(tmp_path, capsys):
    run_dir = unrecorded_run(tmp_path, {"0.weight": torch.zeros(4, 2), "0.bias": torch.zeros(4)})
    before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    assert main(["run", "--resume", str(run_dir), "--no-progress"]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"ddiloco run: error: --resume {run_dir}: this run's model is not the built-in TinyGPT, so it was started "
        f"with a learner command, which its directory does not record: give it again after --, e.g. ddiloco run "
        f"--resume {run_dir} -- python train.py\n")
    assert {path.name: path.read_bytes() for path in run_dir.iterdir()} == before
    assert resumed_learner_command(run_dir, TINY, ["python", "train.py"]) == (("python", "train.py"), None)


@pytest.mark.parametrize("genesis", ["tinygpt", "none", "damaged"])
def test_an_unrecorded_run_that_may_be_the_built_in_learners_resumes_as_before(tmp_path, genesis):
    tensors = {name: param.detach() for name, param in build_model(TINY.model).named_parameters()}
    run_dir = unrecorded_run(tmp_path, tensors if genesis == "tinygpt" else None)
    if genesis == "damaged":
        (run_dir / "genesis.safetensors").write_bytes(b"not a safetensors file")
    assert resumed_learner_command(run_dir, TINY, ()) == ((), None)  # the built-in learner, as before


def test_a_command_every_learner_failed_with_is_not_kept_and_the_built_in_learner_can_be_chosen_again(
        tmp_path, fake_command, capsys, monkeypatch):
    # A --resume with a wrong `-- COMMAND` was recorded though no learner ran with it: the next --resume without one
    # failed the same way, and nothing but an edit of command.json went back to the built-in learner.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text(LEARNER)
    (tmp_path / "broken.py").write_text("raise SystemExit('broken.py: no such model')\n")
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), script=("python", "learner.py", "first")) == 0
    record = RunPaths(run_dir).learner_command.read_text()
    capsys.readouterr()

    assert run(fake_command, "--resume", str(run_dir), script=("python", "broken.py")) == 1
    assert ("no learner ran with python broken.py (every one failed or was refused): the run keeps the command it "
            "ran with before, python learner.py first, for its next --resume\n") in capsys.readouterr().out
    assert RunPaths(run_dir).learner_command.read_text() == record
    assert run(fake_command, "--resume", str(run_dir)) == 0
    assert starts(tmp_path)[-2:] == [["first"]] * 2

    capsys.readouterr()
    assert run(fake_command, "--resume", str(run_dir), "--built-in-learner") == 0
    assert ("resuming with the built-in TinyGPT learner, which differs from the command the run last ran with: "
            "python learner.py first\n") in capsys.readouterr().out
    assert json.loads(RunPaths(run_dir).learner_command.read_text())["command"] == []
    assert len(starts(tmp_path)) == 4  # no learner ran the script this time: the fake built-in learners did


def test_the_built_in_learner_and_a_command_together_are_refused(tmp_path, capsys):
    assert main(["run", "--run-dir", str(tmp_path / "run"), "--built-in-learner", "--", "python", "t.py"]) == EXIT_USAGE
    assert capsys.readouterr().err == ("ddiloco run: error: --built-in-learner and a learner command after -- name two "
                                       "different learners: give one of them\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("damage", "problem"), [
    ('{"command": "python learner.py", "cwd": "/"}', "its command is not a list of strings"),  # ran as its letters
    ('{"command": ["python", "lea', "not a JSON object"),  # dropped without a word, with the recorded flags
    ("[1, 2]", "not a JSON object"),
])
def test_a_damaged_record_of_the_learner_command_is_refused_naming_it_and_left_as_it_was(
        tmp_path, fake_command, capsys, monkeypatch, damage, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text(LEARNER)
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), "--round-files", "all", script=("python", "learner.py")) == 0
    capsys.readouterr()
    record = RunPaths(run_dir).learner_command
    record.write_text(damage)
    config = (run_dir / "config.json").read_bytes()
    with pytest.raises(ValueError, match=rf"--resume {run_dir}: {record} is damaged \({problem}\): restore it from a "
                                         r"backup, or remove it and give the learner command"):
        run(fake_command, "--resume", str(run_dir))
    assert record.read_text() == damage and (run_dir / "config.json").read_bytes() == config


def test_a_resume_from_another_directory_that_every_learner_failed_in_keeps_the_directory_the_command_worked_in(
        tmp_path, fake_command, capsys, monkeypatch):
    # Its relative paths failed from /tmp, and command.json then said "cwd": "/tmp": the next resume from the right
    # directory was told "as given in /tmp", and where the paths worked was lost.
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "learner.py").write_text(LEARNER)
    (elsewhere / "learner.py").write_text("raise SystemExit('not this one')\n")  # the same path, failing from here
    run_dir = tmp_path / "run"
    monkeypatch.chdir(project)
    assert run(fake_command, "--run-dir", str(run_dir), script=("python", "learner.py")) == 0
    record = RunPaths(run_dir).learner_command.read_text()
    capsys.readouterr()
    monkeypatch.chdir(elsewhere)
    assert run(fake_command, "--resume", str(run_dir)) == 1
    assert (f"the run keeps the command it ran with before, python learner.py as given in {project}, for its next "
            "--resume\n") in capsys.readouterr().out
    assert RunPaths(run_dir).learner_command.read_text() == record
