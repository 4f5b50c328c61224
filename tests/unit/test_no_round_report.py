"""A run whose learners all reached their budget without one round committed (every update withheld as non-finite,
or refused) read `completed: 0 rounds committed`, exit 0, though its global model, what `ddiloco export` writes, was
the initial one. It is failed, with the reason (real `ddiloco run`, fake children: tests/fake_learners.py)."""

from __future__ import annotations

from ddiloco.checkpoint import read_json_object
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


def test_the_reason_names_the_syncer_s_refusals(tmp_path, fake_command):
    plan = {"syncer": {"rounds": 0, "rejections": {"non_finite": 7, "stale": 1}}}
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "20", plan=plan)
    out = driver_output(popen)
    assert popen.returncode == 1, out
    assert read_json_object(run_dir / "summary.json")["failure"].endswith(
        "the syncer refused every update (7 non_finite, 1 stale)")


def test_a_run_with_a_round_is_completed(tmp_path, fake_command):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "20")
    out = driver_output(popen)
    assert popen.returncode == 0, out
    assert read_json_object(run_dir / "summary.json")["outcome"] == "completed"
