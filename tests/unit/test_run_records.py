"""A start whose syncer never served puts the run's records back (`run_dir.restore_run_records`): an upgrade probe's
refused `--resume` left `config.json` with today's fields, which the version that wrote the run then refused too. The
process-level case: tests/integration/test_run_upgrade.py (acceptance)."""

from __future__ import annotations

from ddiloco.runtime.run_dir import before_start, restore_run_records


def test_the_records_a_refused_start_rewrote_are_put_back_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    (run / "launcher").mkdir(parents=True)
    (run / "config.json").write_text('{"num_learners": 2}')
    (run / "launcher" / "command.json").write_text('{"command": ["python", "a.py"]}')
    (run / "launcher" / "processes.json").write_text('{"children": {}}')
    before = before_start(run)
    (run / "config.json").write_text('{\n  "num_learners": 2,\n  "quorum": {"progress_timeout_s": 600}\n}\n')
    (run / "launcher" / "command.json").write_text('{"command": ["python", "a.py"], "evaluate": true}')
    (run / "launcher" / "processes.json").write_text('{"children": {"syncer": [123]}}')
    (run / "summary.json").write_text('{"outcome": "failed"}')  # this start's record: kept
    line = restore_run_records(before)
    assert (run / "config.json").read_text() == '{"num_learners": 2}'
    assert (run / "launcher" / "command.json").read_text() == '{"command": ["python", "a.py"]}'
    assert line is not None and "config.json and launcher/command.json are as they were" in line
    assert (run / "launcher" / "processes.json").read_text() == '{"children": {"syncer": [123]}}'  # whom it started
    assert (run / "summary.json").exists()
    assert restore_run_records(before) is None  # nothing differs any more: nothing said


def test_a_new_run_has_no_records_to_put_back(tmp_path):
    before = before_start(tmp_path / "new")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "config.json").write_text("{}")
    assert restore_run_records(before) is None and (tmp_path / "new" / "config.json").exists()
