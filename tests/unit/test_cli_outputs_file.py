"""An output folder that is an existing file (`--out`, `--run-dir`) is refused in one line, exit status 2, before any
work: as `ddiloco run --run-dir FILE` is. `experiment --out FILE` once ran the whole experiment and then ended in a
FileExistsError traceback, `plan goodput --out FILE` the same after the whole simulation, and `chaos --run-dir FILE`
in a NotADirectoryError."""

from __future__ import annotations

import pytest

from ddiloco.cli import main

EXIT_USAGE = 2


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a folder\n")
    return path


def refused(argv: list[str], capsys, flag: str, path) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{flag} {path} is a file, not a directory" in err, err


@pytest.mark.parametrize("name", ["failures", "quality"])
def test_experiment_out_that_is_a_file_is_refused_before_the_experiment(a_file, capsys, no_work, name):
    refused(["experiment", name, "--quick", "--out", str(a_file)], capsys, "--out", a_file)
    assert a_file.read_text() == "not a folder\n"


def test_experiment_out_dev_null_is_refused(capsys, no_work):
    refused(["experiment", "quality", "--out", "/dev/null"], capsys, "--out", "/dev/null")


@pytest.mark.parametrize("extra", [[], ["--paper-grid"]])
def test_plan_goodput_out_that_is_a_file_is_refused_before_the_simulation(a_file, capsys, no_work, extra):
    refused(["plan", "goodput", "--replicas", "2", *extra, "--out", str(a_file)], capsys, "--out", a_file)


def test_plan_goodput_without_plots_does_not_use_out(a_file, capsys):
    # --no-plot writes nothing to --out, so a file there is no mistake to refuse.
    argv = ["plan", "goodput", "--chips", "300000", "--learners", "4", "--failures", "100", "--replicas", "2",
            "--systems", "decoupled", "--no-plot", "--out", str(a_file)]
    assert main(argv) == 0
    assert a_file.read_text() == "not a folder\n"


def test_chaos_run_dir_that_is_a_file_is_refused_before_the_run(a_file, capsys, no_work):
    refused(["chaos", "--quick", "--run-dir", str(a_file)], capsys, "--run-dir", a_file)
    assert a_file.read_text() == "not a folder\n"
