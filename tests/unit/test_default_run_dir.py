"""A command not given a directory makes one of its own, `runs/<kind>-<timestamp>`, and commands started in the same
second each get another (`run_dir.fresh_dir`): a sweep started in a loop with `&` ran one `ddiloco run` and refused
the rest ("choose another --run-dir", which they had not chosen), and two `ddiloco experiment`s wrote one folder.

The clock is held at one second (the time module's `strftime`, which `fresh_dir` reads); the runs are real `ddiloco
run`s with the fake children of tests/fake_learners.py, in this process.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ddiloco import cli
from ddiloco.runtime import run_commands
from ddiloco.runtime.run_dir import RUNS_DIR, fresh_dir
from tests.fake_learners import FAST, run_parser

SECOND = "20261207-190124"


@pytest.fixture
def one_second(tmp_path, monkeypatch) -> Path:
    """Every command runs in `tmp_path` (where `runs/` is made) and reads the same second from the clock."""
    monkeypatch.chdir(tmp_path)
    real = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *at: SECOND if fmt == "%Y%m%d-%H%M%S" and not at else
                        real(fmt, *at))
    return tmp_path


def test_directories_made_in_one_second_by_many_threads_are_each_their_own(one_second):
    made: list[Path] = []
    start = threading.Barrier(12)

    def make() -> None:
        start.wait()
        made.append(fresh_dir("run", flag="--run-dir")[0])

    threads = [threading.Thread(target=make) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(path.name for path in made) == sorted([f"run-{SECOND}"] + [f"run-{SECOND}-{n}" for n in range(2, 13)])
    assert all(path.parent == RUNS_DIR and path.is_dir() and not any(path.iterdir()) for path in made)


def test_the_outermost_folder_made_is_runs_itself_the_first_time(one_second):
    assert fresh_dir("plan", flag="--out") == (RUNS_DIR / f"plan-{SECOND}", RUNS_DIR)
    assert fresh_dir("plan", flag="--out") == (RUNS_DIR / f"plan-{SECOND}-2", RUNS_DIR / f"plan-{SECOND}-2")


def test_a_runs_that_is_a_file_is_one_line_naming_the_flag(one_second):
    RUNS_DIR.write_text("not a folder")
    with pytest.raises(ValueError, match=r"^--out runs is a file, not a directory"):
        fresh_dir("plan", flag="--out")


def test_two_runs_in_one_second_without_a_run_dir_both_run_each_in_its_own_directory(one_second, fake_command):
    def run() -> None:
        args = run_parser().parse_args(["run", "--learners", "2", "--inner-steps", "3", "--no-progress"])
        assert run_commands.run(args, command=fake_command, supervisor_config=FAST) == 0

    run()
    run()  # the same second: the first's directory holds its run
    runs = sorted(RUNS_DIR.iterdir())
    assert [path.name for path in runs] == [f"run-{SECOND}", f"run-{SECOND}-2"]
    assert all((path / "config.json").is_file() and (path / "summary.json").is_file() for path in runs)


def test_a_run_given_a_directory_another_run_filled_is_still_refused_with_the_resume_hint(one_second, fake_command):
    taken = one_second / "mine"
    (taken / "config.json").parent.mkdir()
    (taken / "config.json").write_text("{}")
    args = run_parser().parse_args(["run", "--run-dir", str(taken), "--inner-steps", "3", "--no-progress"])
    with pytest.raises(ValueError, match=rf"^run directory {taken} already exists and is not empty: use --resume "
                                         rf"{taken} to continue it, or choose another --run-dir$"):
        run_commands.run(args, command=fake_command, supervisor_config=FAST)
    assert [path.name for path in taken.iterdir()] == ["config.json"]


def test_two_plans_in_one_second_write_their_plots_in_two_folders(one_second, capsys):
    for _ in range(2):
        assert cli.main(["plan", "bandwidth"]) == 0
    assert sorted(path.name for path in RUNS_DIR.iterdir()) == [f"plan-{SECOND}", f"plan-{SECOND}-2"]
    assert all((path / "plan_bandwidth.png").is_file() for path in RUNS_DIR.iterdir())
    assert f"runs/plan-{SECOND}-2/plan_bandwidth.png" in capsys.readouterr().out


def test_a_chaos_run_or_experiment_takes_its_own_folder_or_an_empty_one_it_is_given(one_second):
    from ddiloco.runtime.run_dir import new_output_dir

    made = [new_output_dir(None, "experiment-quality", flag="--out") for _ in range(2)]
    assert [path.name for path in made] == [f"experiment-quality-{SECOND}", f"experiment-quality-{SECOND}-2"]
    given = one_second / "mine"
    assert new_output_dir(given, "chaos", flag="--run-dir") == given and given.is_dir()
    (given / "plan.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"^run directory {given} already exists and is not empty: choose another "
                                         r"--run-dir$"):
        new_output_dir(given, "chaos", flag="--run-dir")
