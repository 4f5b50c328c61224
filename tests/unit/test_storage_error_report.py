"""A syncer that cannot make its rounds durable (a full disk) refuses every update as `unavailable` and retries
(tests/integration/test_syncer_service.py). `ddiloco run` said nothing of it: its lines read `[syncer] 0 rounds`, and
a run whose learners all reached their budget that way ended `completed`, exit 0, with 0 rounds committed; the cause
was in logs/syncer.log and syncer_status.json alone (real `ddiloco run`, fake children: tests/fake_learners.py)."""

from __future__ import annotations

from ddiloco.checkpoint import read_json_object
from tests.fake_learners import driver_output, start_driver

FULL = "the syncer cannot make round 0 durable ([Errno 28] No space left on device)"


def test_a_syncer_that_cannot_write_its_rounds_is_said_at_once_and_the_run_is_failed(tmp_path, fake_command):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "60",
                                  plan={"syncer": {"storage_error": FULL}})
    out = driver_output(popen)
    assert popen.returncode == 1, out
    assert out.count(f"[syncer] cannot commit rounds: {FULL}; updates are refused until it can") == 1, out
    summary = read_json_object(run_dir / "summary.json")
    assert summary["outcome"] == "failed" and summary["syncer"]["storage_error"] == FULL, summary
    assert summary["failure"] == (f"the syncer could not commit rounds when the run ended: {FULL}; the learners' "
                                  "updates since its last commit were refused (logs/syncer.log says since when)")
    assert summary["failure"] in " ".join(out.split()) and "completed:" not in out, out  # (the console wraps it)


def test_a_syncer_that_writes_its_rounds_says_nothing_of_it(tmp_path, fake_command):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "20")
    out = driver_output(popen)
    assert popen.returncode == 0 and "cannot commit" not in out, out
    assert read_json_object(run_dir / "summary.json")["syncer"]["storage_error"] is None
