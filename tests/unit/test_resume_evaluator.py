"""`ddiloco run --resume DIR` keeps the evaluator the run was started with: `launcher/command.json` records whether
the run had one, beside its learner command. A resume of a script run started with `--evaluate` used to start only
the syncer and the learners (a script's default is no evaluator), and its summary then called the first session's
validation loss the final one. `--evaluate` or `--no-evaluate` given on the resume is used, and the console says it
differs, as for `--nproc-per-learner` and `--device`; a run recorded before this keeps the default, as before.

Real processes: the fake syncer of tests/fake_learners.py and a learner script that is done at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import FAST, run_parser

SCRIPT = ("python", "learner.py")


def run(fake_command: tuple[str, ...], *argv: str, script: tuple[str, ...] = ()) -> int:
    """`ddiloco run --learners 2 ARGV -- SCRIPT` with the fake syncer (the CLI cuts the script off at `--`)."""
    from ddiloco.runtime import run_commands

    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", "--threads", "1", *argv])
    args.script = list(script)
    return run_commands.run(args, command=fake_command, supervisor_config=FAST)


def had_evaluator(run_dir: Path) -> bool:
    """Whether the latest session ran an evaluator (summary.json's `evaluator` is null when it had none)."""
    return (read_json_object(RunPaths(run_dir).summary) or {}).get("evaluator") is not None


@pytest.fixture
def evaluated_run(tmp_path, fake_command, capsys, monkeypatch) -> Path:
    """A script run started with --evaluate that has finished."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text("")
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), "--evaluate", script=SCRIPT) == 0
    assert had_evaluator(run_dir)
    capsys.readouterr()
    return run_dir


def test_a_resume_without_the_flag_keeps_the_runs_evaluator_and_says_so(evaluated_run, fake_command, capsys):
    assert run(fake_command, "--resume", str(evaluated_run)) == 0
    assert had_evaluator(evaluated_run), "the resume dropped the evaluator the run was started with"
    assert "resuming with the run's --evaluate\n" in capsys.readouterr().out
    assert json.loads(RunPaths(evaluated_run).learner_command.read_text())["evaluate"] is True


def test_no_evaluate_on_the_resume_is_used_and_said_to_differ(evaluated_run, fake_command, capsys):
    assert run(fake_command, "--resume", str(evaluated_run), "--no-evaluate") == 0
    assert not had_evaluator(evaluated_run)
    out = capsys.readouterr().out
    assert "resuming with --no-evaluate, which differs from what the run last ran with: --evaluate\n" in out, out
    # What the resume ran with is what the next resume runs.
    assert json.loads(RunPaths(evaluated_run).learner_command.read_text())["evaluate"] is False


def test_a_script_run_without_an_evaluator_resumes_without_one_and_without_a_note(tmp_path, fake_command, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "learner.py").write_text("")
    run_dir = tmp_path / "run"
    assert run(fake_command, "--run-dir", str(run_dir), script=SCRIPT) == 0
    assert run(fake_command, "--resume", str(run_dir)) == 0
    assert not had_evaluator(run_dir)
    assert "evaluate" not in capsys.readouterr().out


def test_a_run_recorded_before_the_evaluator_was_resumes_as_before(evaluated_run, fake_command, capsys):
    paths = RunPaths(evaluated_run)
    atomic_write_json(paths.learner_command, {"command": list(SCRIPT), "cwd": str(evaluated_run.parent)})
    assert run(fake_command, "--resume", str(evaluated_run)) == 0
    assert not had_evaluator(evaluated_run)  # a script's default
    assert "evaluate" not in capsys.readouterr().out
