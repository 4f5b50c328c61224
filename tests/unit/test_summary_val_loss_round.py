"""The summary says at which round its validation loss was measured (summary.json's `final_val_loss_round`), and does
not call a loss measured before the run's last rounds the final one. A `--resume` that ran no evaluator reported
"1030 rounds committed, final validation loss 0.0056", a loss the first session had measured at round 425.

Hand-written run directories, no processes.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from ddiloco.checkpoint import atomic_write_json
from ddiloco.runtime.report import build_summary
from ddiloco.runtime.report_table import print_summary
from ddiloco.runtime.run_paths import RunPaths


def write_lines(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def run_of(tmp_path: Path, *, rounds: int, evaluations: list[tuple[int, float]]) -> RunPaths:
    """A run of one learner with `rounds` committed rounds and the evaluator's (rounds committed, loss) lines."""
    paths = RunPaths(tmp_path / "run")
    write_lines(paths.rounds, [{"round": r, "fragment": 0, "version": r + 1, "participants": []}
                               for r in range(rounds)])
    write_lines(paths.evaluator_metrics, [{"step": r, "time": 100.0 + r, "eval/val_loss": loss,
                                           "eval/rounds_committed": r} for r, loss in evaluations])
    write_lines(paths.launcher_metrics, [{"event": "run_started", "time": 99.0}])
    return paths


def caption(summary) -> str:
    console = Console(width=300, record=True)
    print_summary(summary, console)
    return console.export_text()


def test_a_loss_older_than_the_last_rounds_says_its_round_and_is_not_called_final(tmp_path):
    paths = run_of(tmp_path, rounds=1030, evaluations=[(0, 1.74), (425, 0.0056)])
    summary = build_summary(paths, num_learners=1, outcome="interrupted", wall_time_s=30.0, evaluator=None)
    assert summary["final_val_loss"] == 0.0056 and summary["final_val_loss_time"] == 525.0  # as before
    assert summary["final_val_loss_round"] == 425
    text = caption(summary)
    assert "final validation loss 0.0056" not in text, text
    assert "1030 rounds committed, validation loss 0.0056 at round 425" in text, text
    assert ("this session ran no evaluator: the validation loss is the one measured at round 425, 605 rounds before "
            "the last") in text, text


def test_a_loss_measured_at_the_last_round_is_the_final_one(tmp_path):
    paths = run_of(tmp_path, rounds=12, evaluations=[(0, 1.74), (12, 0.25)])
    summary = build_summary(paths, num_learners=1, outcome="completed", wall_time_s=3.0, evaluator=("done", ""))
    assert summary["final_val_loss_round"] == 12
    text = caption(summary)
    assert "12 rounds committed, final validation loss 0.2500," in text, text
    assert "no evaluator" not in text


def test_the_round_comes_from_the_status_file_without_metrics(tmp_path):
    paths = run_of(tmp_path, rounds=5, evaluations=[])
    paths.evaluator_metrics.unlink()
    atomic_write_json(paths.evaluator_status, {"time": 200.0, "rounds_committed": 3, "val_loss": 0.5})
    summary = build_summary(paths, num_learners=1, outcome="completed", wall_time_s=3.0, evaluator=("done", ""))
    assert (summary["final_val_loss"], summary["final_val_loss_round"]) == (0.5, 3)
    assert "validation loss 0.5000 at round 3" in caption(summary)


def test_a_run_without_validation_loss_has_no_round(tmp_path):
    paths = run_of(tmp_path, rounds=5, evaluations=[])
    summary = build_summary(paths, num_learners=1, outcome="completed", wall_time_s=3.0)
    assert summary["final_val_loss"] is None and summary["final_val_loss_round"] is None
    assert "5 rounds committed, final validation loss -," in caption(summary)
