"""`ddiloco chaos`'s arguments, checked before anything runs: the chaos heartbeat defaults under `--config`, flags
that the chosen plan would ignore, seeds and durations out of range, and the plan file's messages."""

from __future__ import annotations

import json

import pytest

from ddiloco.chaos import commands
from ddiloco.chaos.plan import load_plan
from ddiloco.cli import build_parser, main
from ddiloco.run_config import MAX_SEED

PLAN = "duration: 20s\nfaults:\n  - {at: 5s, kind: crash, target: learner-0}\n"


def _args(*argv: str):
    return build_parser().parse_args(["chaos", *argv])


def _refused(tmp_path, capsys, *argv: str) -> str:  # used with `no_work`
    """Run `ddiloco chaos ARGV` into a fresh run directory: it must be refused (exit 2, one line) before that
    directory is made."""
    run_dir = tmp_path / "run"
    assert main(["chaos", *argv, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not run_dir.exists()
    return err


def test_a_config_file_keeps_the_chaos_heartbeat_defaults_it_does_not_set(tmp_path):
    seed_only = tmp_path / "seed.json"
    seed_only.write_text(json.dumps({"seed": 3}))
    config = commands._run_config(_args("--config", str(seed_only)))
    assert config.seed == 3
    assert config.quorum.heartbeat_timeout_s == commands.CHAOS_HEARTBEAT_TIMEOUT_S
    assert config.learner.heartbeat_every_s == commands.CHAOS_HEARTBEAT_EVERY_S


def test_a_config_file_or_a_flag_that_sets_the_heartbeats_wins(tmp_path):
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"quorum": {"heartbeat_timeout_s": 12.0}, "learner": {"heartbeat_every_s": 2.0}}))
    config = commands._run_config(_args("--config", str(both)))
    assert (config.quorum.heartbeat_timeout_s, config.learner.heartbeat_every_s) == (12.0, 2.0)
    config = commands._run_config(_args("--config", str(both), "--heartbeat-timeout-s", "7"))
    assert config.quorum.heartbeat_timeout_s == 7.0


def test_the_saved_run_config_says_the_runs_are_unbounded(tmp_path):
    # The top-level config.json said inner_steps 60 (from the file) while every system ran 10**9.
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"inner_steps": 60}))
    assert commands._run_config(_args("--config", str(steps))).inner_steps == 10**9


@pytest.mark.parametrize(("argv", "flag"), [
    (("--quick", "--inner-steps", "60"), "--inner-steps"),
    (("--plan", "PLAN", "--plan-seed", "3"), "--plan-seed"),
    (("--plan", "PLAN", "--kill-every-s", "5"), "--kill-every-s"),
    (("--plan", "PLAN", "--crash-recovery", "restart"), "--crash-recovery"),
    (("--plan", "PLAN", "--chips-per-learner", "4"), "--chips-per-learner"),
    (("--plan", "PLAN", "--recovery-scale-s", "5"), "--recovery-scale-s"),
    (("--quick", "--kill-every-s", "5"), "--kill-every-s"),
    (("--soak", "--duration", "30", "--chips-per-learner", "4"), "--chips-per-learner"),
])
def test_a_flag_the_run_would_ignore_is_refused_naming_it(tmp_path, capsys, no_work, argv, flag):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    err = _refused(tmp_path, capsys, *(str(plan) if a == "PLAN" else a for a in argv))
    assert flag in err


@pytest.mark.parametrize("seed", ["-1", str(MAX_SEED + 1), "99999999999999999999"])
def test_a_plan_seed_out_of_range_is_refused(tmp_path, capsys, no_work, seed):
    assert "--plan-seed" in _refused(tmp_path, capsys, "--quick", "--plan-seed", seed)


def test_a_drawn_plan_too_short_for_its_margins_names_the_flag_to_change(tmp_path, capsys, no_work):
    err = _refused(tmp_path, capsys, "--mtbi-per-chip", "1", "--duration", "20")
    assert "--duration" in err and "20 s" in err and "margin_s" not in err


def test_a_soak_too_short_names_the_flag_to_change(tmp_path, capsys, no_work):
    err = _refused(tmp_path, capsys, "--soak", "--duration", "15")
    assert "--duration" in err and "duration_s" not in err


@pytest.mark.parametrize("duration", [".nan", "0s", "0", ".inf"])
def test_a_plan_duration_that_is_not_a_positive_time_says_so_alike(tmp_path, duration):
    path = tmp_path / "plan.yaml"
    path.write_text(f"duration: {duration}\nfaults: []\n")
    with pytest.raises(ValueError, match="expected a time > 0"):
        load_plan(path, num_learners=2)


def test_a_parameter_with_an_exponent_is_a_number_and_one_in_quotes_is_not(tmp_path):
    # YAML 1.1 would read 1e308 (no dot, no sign in the exponent) as a string; the plan's loader reads a number.
    path = tmp_path / "plan.yaml"
    path.write_text("duration: 20s\nfaults:\n  - {at: 5s, kind: straggler, target: 0, duration: 5s, factor: 1e308}\n")
    with pytest.raises(ValueError, match=r"plan.yaml, fault 0: factor=1e\+308 is invalid for straggler: expected"):
        load_plan(path, num_learners=2)
    path.write_text("duration: 20s\nfaults:\n  - {at: 5s, kind: straggler, target: 0, duration: 5s, factor: '3'}\n")
    with pytest.raises(ValueError, match="not a number") as error:
        load_plan(path, num_learners=2)
    assert "plan.yaml, fault 0: factor '3'" in str(error.value)
