"""`ddiloco experiment`'s progress lines go to stderr whole: one line each, never wrapped at the 80 columns Rich
assumes when stderr is not a terminal (a log file, a pipe), so that `grep` and scripts see every line entire."""

from __future__ import annotations

from types import SimpleNamespace

from ddiloco.cli import main

LONG_LINE = ("[failures] elastic_data_parallel: loss 3.0082, goodput 0.298, uptime 0.504 (1.5 s) "
             "and more words so that the line runs well past eighty columns")


def test_progress_lines_are_not_wrapped_when_stderr_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)

    def run_experiment(name, *, quick, seed, progress):
        progress(LONG_LINE)
        return SimpleNamespace(checks=[], wall_s=0.0, to_json=lambda: {})

    monkeypatch.setattr("ddiloco.sim.experiments.run_experiment", run_experiment)
    monkeypatch.setattr("ddiloco.sim.report.write_run", lambda result, out_dir, command: [])
    monkeypatch.setattr("ddiloco.sim.report.rich_table", lambda result: "table")
    assert main(["experiment", "failures", "--quick", "--out", str(tmp_path / "out")]) == 0
    assert LONG_LINE in capsys.readouterr().err.splitlines()
