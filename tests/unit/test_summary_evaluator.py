"""A run whose evaluator was given up says so in its summary (summary.json's `evaluator`, a line under the table): it
ended "completed" with no validation loss and no word of why, though the evaluator had failed at every start."""

from __future__ import annotations

import json

from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import FAST, run_parser

ERROR = "ValueError: parameter '0.weight' is not initialized yet"


def run(fake_command, run_dir, capsys):
    from ddiloco.runtime import run_commands

    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", "--inner-steps", "300",
                                    "--run-dir", str(run_dir)])
    code = run_commands.run(args, command=fake_command, supervisor_config=FAST)
    return code, capsys.readouterr().out


def test_an_evaluator_given_up_is_named_in_the_summary_and_under_the_table(tmp_path, fake_command, capsys,
                                                                            monkeypatch):
    monkeypatch.setenv("FAKE_PLAN", json.dumps({"evaluator": {"exit_code": 1, "message": ERROR}}))
    code, out = run(fake_command, tmp_path / "run", capsys)
    assert code == 0  # the learners finished: a run is finished without its evaluator
    evaluator = json.loads(RunPaths(tmp_path / "run").summary.read_text())["evaluator"]
    assert evaluator["state"] == "failed" and evaluator["reason"].startswith(ERROR), evaluator
    assert f"the evaluator failed, so the run measured no validation loss: {ERROR}" in out


def test_a_run_whose_evaluator_did_its_work_says_nothing_more(tmp_path, fake_command, capsys, monkeypatch):
    monkeypatch.delenv("FAKE_PLAN", raising=False)
    code, out = run(fake_command, tmp_path / "run", capsys)
    assert code == 0 and "the evaluator failed" not in out
    assert json.loads(RunPaths(tmp_path / "run").summary.read_text())["evaluator"]["state"] in ("done", "stopped")
