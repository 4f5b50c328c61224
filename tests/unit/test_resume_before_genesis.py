"""A run whose learners all failed before any joined (a script whose model has fewer tensors than --num-fragments)
has a config.json and no genesis. `ddiloco run` then said `once what failed is fixed, retry it with: ddiloco run
--resume RUN`, and that resume refused the fix: `an existing run cannot change --num-fragments 2 (the run has 4)`.
Nothing was made with the run's settings before its genesis, so a resume may change them then; once a learner has
joined it may not (tests/integration/test_user_errors.py). Real `ddiloco run`, fake children
(tests/fake_learners.py)."""

from __future__ import annotations

import pytest

from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_state import GENESIS_FILE
from tests.fake_learners import WAIT_S, driver_output, start_driver


def test_a_resume_before_the_genesis_may_change_the_runs_settings_and_after_it_may_not(tmp_path, fake_command):
    first, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "5")
    assert first.wait(timeout=WAIT_S) == 0, driver_output(first)
    assert RunConfig.load(run_dir / "config.json").diloco.num_fragments == 4
    assert not (run_dir / GENESIS_FILE).exists()  # the fake learners never join

    resumed, _ = start_driver(tmp_path, fake_command, "--resume", str(run_dir), "--num-fragments", "2",
                              "--inner-steps", "5")
    out = driver_output(resumed)
    assert resumed.returncode == 0, out
    assert (f"--resume {run_dir}: the run has no genesis yet (no learner ever joined), so its settings may change: "
            "--num-fragments 2 (the run has 4)") in " ".join(out.split()), out
    assert RunConfig.load(run_dir / "config.json").diloco.num_fragments == 2

    (run_dir / GENESIS_FILE).write_bytes(b"")  # a learner joined: the run was made with its settings
    before = (run_dir / "config.json").read_bytes()
    refused, _ = start_driver(tmp_path, fake_command, "--resume", str(run_dir), "--num-fragments", "1")
    out = driver_output(refused)
    # (the driver calls `run_commands.run`, not the CLI: the ValueError that `ddiloco` prints in one line, exit 2)
    assert refused.returncode == 1 and "ValueError: --resume" in out, out
    assert "an existing run cannot change --num-fragments 1 (the run has 2)" in out, out
    assert (run_dir / "config.json").read_bytes() == before


@pytest.mark.acceptance  # the default suite's 15 minutes
def test_a_resume_of_a_run_whose_learners_are_all_done_says_it_trains_nothing(tmp_path, fake_command):
    # It started everything, each learner was done at once, and nothing said that --inner-steps was the thing to give.
    first, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "5")
    assert first.wait(timeout=WAIT_S) == 0, driver_output(first)
    note = ("every learner of this run is done at --inner-steps 5 or past it: this resume trains nothing (give a "
            "larger --inner-steps to train on)")
    again, _ = start_driver(tmp_path, fake_command, "--resume", str(run_dir))
    out = driver_output(again)
    assert again.returncode == 0 and note in " ".join(out.split()), out
    extended, _ = start_driver(tmp_path, fake_command, "--resume", str(run_dir), "--inner-steps", "8")
    out = driver_output(extended)
    assert extended.returncode == 0 and "trains nothing" not in out, out
