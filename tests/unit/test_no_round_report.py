"""A run whose learners all reached their budget without one round committed (every update withheld as non-finite,
or refused) read `completed: 0 rounds committed`, exit 0, though its global model, what `ddiloco export` writes, was
the initial one. It is failed, with the reason (real `ddiloco run`, fake children: tests/fake_learners.py)."""

from __future__ import annotations

from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.runtime.run_commands import _no_round_failure
from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import driver_output, start_driver


def test_a_run_without_a_round_committed_is_failed_and_says_why(tmp_path, fake_command):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "20", plan={"syncer": {"rounds": 0}})
    out = driver_output(popen)
    assert popen.returncode == 1, out
    summary = read_json_object(run_dir / "summary.json")
    assert summary["outcome"] == "failed" and summary["rounds_committed"] == 0, summary
    assert summary["failure"] == ("no round was committed, so the global model is still the initial one: no update "
                                  "reached the syncer (a learner withholds one whose pseudo-gradient is not finite: "
                                  "logs/learner-N.log says so)")
    assert summary["failure"] in " ".join(out.split()) and "completed:" not in out, out
    assert all(learner["state"] == "done" for learner in summary["learners"].values())


def test_the_reason_names_the_syncer_s_refusals(tmp_path):
    paths = RunPaths(tmp_path)
    atomic_write_json(paths.syncer_status, {"rounds_committed": 0, "rejections": {"non_finite": 7, "stale": 1}})
    assert _no_round_failure(paths).endswith("the syncer refused every update (7 non_finite, 1 stale)")
    # A run with a round is completed: tests/unit/test_storage_error_report.py, exit 0 with the same fake children.
