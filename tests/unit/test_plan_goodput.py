"""The goodput simulator: its building blocks by hand, its systems against closed forms, the paper grid."""

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest

from ddiloco.plan import commands
from ddiloco.plan.failures import (
    SECONDS_PER_YEAR,
    FailureModel,
    exponentiated_weibull_cdf,
    poisson_times,
    sample_recovery_s,
)
from ddiloco.plan.goodput import Estimate, simulate
from ddiloco.plan.paper_grid import PAPER_CHIPS, PAPER_GOODPUT_PCT, PAPER_TOLERANCE_PCT, run_paper_grid
from ddiloco.plan.scenario import LayoutConfig, ReconfigurationCosts, ScavengeConfig, Scenario, SimulationConfig
from ddiloco.plan.speed import learner_slowdowns, quorum_speed
from ddiloco.plan.systems import data_parallel_run, quorum_stalls, reconfiguration_pauses
from ddiloco.plan.timeline import StepFunction, coalesce_pauses, integrate_product

QUICK = SimulationConfig(failures=3000, replicas=3, seed=7)


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- failure process -----------------------------------------------------------------------------


def test_cluster_of_1_2m_chips_fails_about_every_26_seconds():
    model = FailureModel()
    assert model.mtbi_s == SECONDS_PER_YEAR
    assert 1 / model.failure_rate_per_s(1_200_000) == pytest.approx(26.3, abs=0.05)


def test_poisson_times_are_sorted_inside_the_window_with_the_right_count():
    times = poisson_times(rng(), rate_per_s=2.0, start_s=-10.0, end_s=50_000.0)
    assert np.all(np.diff(times) >= 0)
    assert times[0] >= -10.0 and times[-1] < 50_000.0
    # 100_010 expected; Poisson sd ~316, so 1 % is more than 3 sd.
    assert len(times) == pytest.approx(100_020, rel=0.01)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.5, rel=0.01)  # exponential inter-arrival times


def test_exponentiated_weibull_reduces_to_exponential_and_matches_its_cdf():
    exponential = FailureModel(recovery_scale_s=100.0, recovery_shape=1.0, recovery_exponent=1.0)
    assert exponential.recovery_mean_s() == pytest.approx(100.0, rel=1e-4)
    samples = sample_recovery_s(rng(), 200_000, exponential)
    assert samples.mean() == pytest.approx(100.0, rel=0.01)
    model = FailureModel()
    samples = np.sort(sample_recovery_s(rng(1), 100_000, model))
    # The CDF at the sorted samples is uniform: largest gap to the empirical CDF (Kolmogorov) is small.
    empirical = np.arange(1, len(samples) + 1) / len(samples)
    assert np.max(np.abs(exponentiated_weibull_cdf(samples, model) - empirical)) < 0.01
    assert samples.mean() == pytest.approx(model.recovery_mean_s(), rel=0.02)


def test_lost_capacity_is_slice_chips_times_mean_recovery_over_mtbi():
    model = FailureModel(chips_per_slice=100, recovery_scale_s=3600.0, recovery_shape=1.0, recovery_exponent=1.0,
                         mtbi_s=360_000.0)
    assert model.lost_capacity_fraction() == pytest.approx(100 * 3600 / 360_000, rel=1e-4)


@pytest.mark.parametrize(("field", "value"), [("mtbi_s", 0.0), ("chips_per_slice", 0), ("recovery_shape", -1.0),
                                              ("recovery_scale_s", math.inf)])
def test_failure_model_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FailureModel(**{field: value})


# ---- timelines -----------------------------------------------------------------------------------


def test_coalesce_pauses_absorbs_events_inside_a_pause_by_hand():
    starts, ends = coalesce_pauses(np.array([0.0, 5.0, 12.0, 22.0, 30.0]), np.array([10.0, 10.0, 10.0, 3.0, 1.0]))
    # 5 falls inside [0, 10); 22 is exactly at the end of [12, 22), so it opens a new pause.
    np.testing.assert_array_equal(starts, [0.0, 12.0, 22.0, 30.0])
    np.testing.assert_array_equal(ends, [10.0, 22.0, 25.0, 31.0])


def test_step_function_values_and_integrals_by_hand():
    down = StepFunction(np.array([2.0, 5.0, 4.0]), np.array([3.0, -3.0, 1.0]), initial=1.0)
    # 1 before 2, 4 on [2, 4), 5 on [4, 5), 2 after 5.
    np.testing.assert_array_equal(down.values_at(np.array([0.0, 2.0, 4.5, 9.0])), [1.0, 4.0, 5.0, 2.0])
    assert down.integral(np.array([0.0]), np.array([6.0])) == pytest.approx(2 * 1 + 2 * 4 + 1 * 5 + 1 * 2)
    assert down.integral(np.array([1.0, 4.5]), np.array([3.0, 5.5])) == pytest.approx((1 + 4) + (2.5 + 1))
    paused = StepFunction.indicator(np.array([1.0]), np.array([4.5]))
    assert integrate_product([down, paused], 0.0, 6.0) == pytest.approx(1 + 4 * 2 + 5 * 0.5)


def test_reconfiguration_pauses_downscale_then_upscale_by_hand():
    # A failure at 100 (downscale 10 s), its slice returns at 400 (upscale 20 s), a second failure at 405
    # is absorbed by the upscale; everything is clipped to the horizon of 1000 s.
    starts, ends = reconfiguration_pauses([(np.array([100.0, 405.0]), 10.0), (np.array([400.0, 995.0]), 20.0)],
                                          horizon_s=1000.0)
    np.testing.assert_array_equal(starts, [100.0, 400.0, 995.0])
    np.testing.assert_array_equal(ends, [110.0, 420.0, 1000.0])


def test_quorum_stalls_by_hand():
    horizon = 10.0
    running = [StepFunction.from_values(np.array([0.0, 2.0, 6.0, 10.0]), np.array([1.0, 0.0, 1.0, 0.0])),
               StepFunction.from_values(np.array([0.0, 4.0, 8.0, 10.0]), np.array([1.0, 0.0, 1.0, 0.0])),
               StepFunction.from_values(np.array([0.0, 10.0]), np.array([1.0, 0.0]))]
    present = StepFunction(np.empty(0), np.empty(0), initial=3.0)
    # Training counts: 3 on [0,2), 2 on [2,4), 1 on [4,6), 2 on [6,8), 3 on [8,10).
    starts, ends = quorum_stalls(running, present, quorum=2, horizon_s=horizon)
    np.testing.assert_array_equal(starts, [4.0])
    np.testing.assert_array_equal(ends, [6.0])
    starts, ends = quorum_stalls(running, present, quorum=3, horizon_s=horizon)
    assert sum(ends - starts) == pytest.approx(6.0)
    # A quorum above the learners present is capped at them (nobody waits for a learner that is gone).
    one_present = StepFunction(np.empty(0), np.empty(0), initial=1.0)
    starts, _ = quorum_stalls(running[2:], one_present, quorum=3, horizon_s=horizon)
    assert len(starts) == 0


# ---- systems against closed forms ------------------------------------------------------------------


def test_data_parallel_restart_matches_renewal_closed_form():
    model, costs = FailureModel(), ReconfigurationCosts(restart_s=60.0)
    chips, horizon = 300_000, 2e6
    useful, training = data_parallel_run(rng(), chips, model, costs, horizon)
    rate = model.failure_rate_per_s(chips)
    # Failures during a restart are absorbed: a cycle is an exponential run plus one restart.
    assert useful == training
    assert training / horizon == pytest.approx(1 / (1 + rate * 60.0), abs=0.01)


def test_data_parallel_loses_progress_since_the_last_checkpoint():
    model = FailureModel()
    costs = ReconfigurationCosts(restart_s=60.0, checkpoint_interval_s=30.0)
    chips, horizon = 300_000, 2e6
    useful, training = data_parallel_run(rng(), chips, model, costs, horizon)
    mean_run = model.mtbi_s / chips
    # E[run mod c] for an exponential run of mean mu: mu - c e^(-c/mu) / (1 - e^(-c/mu)).
    c = 30.0
    lost_per_run = mean_run - c * math.exp(-c / mean_run) / (1 - math.exp(-c / mean_run))
    assert (training - useful) / training == pytest.approx(lost_per_run / mean_run, abs=0.01)


def test_elastic_pauses_downscale_and_upscale_per_failure_and_loses_the_slice_while_it_is_away():
    scenario = Scenario(layout=LayoutConfig(chips=600_000))
    result = simulate("elastic_data_parallel", scenario, QUICK)
    rate = scenario.failures.failure_rate_per_s(600_000)
    pause_s = scenario.costs.downscale_s + scenario.costs.upscale_s
    # Failures and returns (the same rate in steady state) each pause the job, absorbed when paused.
    assert result.uptime.mean == pytest.approx(1 / (1 + rate * pause_s), abs=0.01)
    expected = result.uptime.mean * (1 - scenario.failures.lost_capacity_fraction())
    assert result.goodput.mean == pytest.approx(expected, abs=0.005)


def test_decoupled_with_m_learners_behaves_like_elastic_on_n_over_m_chips():
    # The paper's rule of thumb; exact in this model, since a failure pauses only its own learner.
    decoupled = simulate("decoupled", Scenario(layout=LayoutConfig(chips=1_200_000, learners=4)), QUICK)
    elastic = simulate("elastic_data_parallel", Scenario(layout=LayoutConfig(chips=300_000)), QUICK)
    assert decoupled.goodput.mean == pytest.approx(elastic.goodput.mean, abs=0.01)
    assert decoupled.uptime.mean > 0.99 > elastic.uptime.mean


def test_a_larger_quorum_stalls_everyone_while_any_learner_pauses():
    layouts = [LayoutConfig(chips=1_200_000, learners=8, min_quorum=k) for k in (1, 4, 8)]
    results = [simulate("decoupled", Scenario(layout=layout), QUICK) for layout in layouts]
    uptimes = [r.uptime.mean for r in results]
    goodputs = [r.goodput.mean for r in results]
    assert uptimes[0] == pytest.approx(1.0, abs=1e-3)
    assert uptimes[0] > uptimes[1] > uptimes[2]
    assert goodputs[0] > goodputs[1] > goodputs[2]
    # K = M: the model advances only while no learner is paused; each pauses ~1/(1 + lambda_m (D + U)).
    rate = FailureModel().failure_rate_per_s(1_200_000 / 8)
    assert uptimes[2] == pytest.approx((1 / (1 + rate * 20.0)) ** 8, abs=0.02)


def test_quorum_speed_waits_for_the_kth_fastest_by_hand():
    slowdowns = learner_slowdowns(4, slow_fraction=0.5, slowdown=0.25)
    np.testing.assert_array_equal(slowdowns, [0.0, 0.0, 0.25, 0.25])
    lockstep = quorum_speed(rng(), slowdowns, quorum=4, spread=0.0)
    np.testing.assert_allclose(lockstep.busy_fraction, [0.8, 0.8, 1.0, 1.0])
    np.testing.assert_allclose(lockstep.rate, [0.8] * 4)
    free = quorum_speed(rng(), slowdowns, quorum=2, spread=0.0)
    np.testing.assert_allclose(free.busy_fraction, [1.0] * 4)
    np.testing.assert_allclose(free.rate, [1.0, 1.0, 0.8, 0.8])


def test_mixed_hardware_with_quorum_m_costs_goodput_like_the_paper():
    # Paper: 4 + 4 learners, ~18 % speed gap, 10 % variance: K = 8 gives 84 % goodput, K = 1 gives 100 %.
    # Failures made negligible (MTBI of a million years) to isolate the speed effect.
    failure_free = FailureModel(mtbi_s=1e6 * SECONDS_PER_YEAR)
    results = {}
    for k in (1, 8):
        layout = LayoutConfig(chips=8 * 256, learners=8, min_quorum=k, slow_learner_fraction=0.5,
                              slow_learner_slowdown=0.18, step_time_spread=0.1)
        results[k] = simulate("decoupled", Scenario(layout=layout, failures=failure_free), QUICK)
    assert results[1].goodput.mean == pytest.approx(1.0, abs=1e-3)
    assert results[8].goodput.mean == pytest.approx(0.84, abs=0.03)
    assert results[1].tokens_per_hour.mean > results[8].tokens_per_hour.mean


def test_scavenged_learners_add_tokens_to_decoupled_but_not_to_rigid_data_parallel():
    base = Scenario(layout=LayoutConfig(chips=300_000, learners=4))
    extra = dataclasses.replace(base, scavenge=ScavengeConfig(extra_learners=4, availability=0.5))
    decoupled = [simulate("decoupled", s, QUICK).tokens_per_hour.mean for s in (base, extra)]
    rigid = [simulate("data_parallel", s, QUICK).tokens_per_hour.mean for s in (base, extra)]
    # Four more learners half of the time: about +50 % tokens (less the joins and their failures).
    assert decoupled[1] / decoupled[0] == pytest.approx(1.5, abs=0.05)
    assert rigid[1] == rigid[0]


def test_same_seed_same_bits_other_seed_other_draws():
    scenario = Scenario(layout=LayoutConfig(chips=600_000, learners=4))
    first = simulate("decoupled", scenario, QUICK)
    assert simulate("decoupled", scenario, QUICK) == first
    other = simulate("decoupled", scenario, dataclasses.replace(QUICK, seed=8))
    assert other.goodput.mean != first.goodput.mean


def test_estimate_is_a_student_t_interval():
    estimate = Estimate.of(np.array([1.0, 2.0, 3.0]))
    assert estimate.mean == 2.0
    assert estimate.high - estimate.mean == pytest.approx(4.303 * 1.0 / math.sqrt(3))


@pytest.mark.parametrize(("kwargs", "field"), [({"chips": 0}, "chips"), ({"learners": 0}, "learners"),
                                               ({"min_quorum": 9}, "min_quorum"),
                                               ({"slow_learner_fraction": 1.5}, "slow_learner_fraction")])
def test_layout_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        LayoutConfig(**kwargs)


def test_scenario_rejects_slices_larger_than_a_learner():
    with pytest.raises(ValueError, match="chips_per_slice=256"):
        Scenario(layout=LayoutConfig(chips=1000, learners=8))


# ---- the paper's grid ----------------------------------------------------------------------------


def test_paper_grid_within_four_points_of_every_cell():
    grid = run_paper_grid()
    assert grid.chips == PAPER_CHIPS
    simulated = grid.simulated_pct()
    assert set(simulated) == set(PAPER_GOODPUT_PCT)
    for row, values in simulated.items():
        for chips, value, paper in zip(PAPER_CHIPS, values, PAPER_GOODPUT_PCT[row], strict=True):
            assert abs(value - paper) <= PAPER_TOLERANCE_PCT, f"{row} at {chips} chips: {value:.1f} vs {paper}"


# ---- command line -------------------------------------------------------------------------------


def parser():
    top = argparse.ArgumentParser(prog="ddiloco")
    commands.add_parser(top.add_subparsers(dest="command", required=True))
    return top


def test_cli_goodput_prints_a_table_then_json_last(capsys, tmp_path):
    args = parser().parse_args(["plan", "goodput", "--chips", "300000", "--learners", "4", "--failures", "500",
                                "--replicas", "2", "--json", "--out", str(tmp_path)])
    assert commands.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    payload = json.loads(lines[-1])
    assert [r["system"] for r in payload["results"]] == ["data_parallel", "elastic_data_parallel", "decoupled"]
    assert 0 < payload["results"][2]["goodput"]["mean"] <= 1
    assert (tmp_path / "plan_goodput.png").stat().st_size > 0


def test_cli_paper_grid_json_has_the_documented_keys(capsys):
    args = parser().parse_args(["plan", "goodput", "--paper-grid", "--failures", "300", "--replicas", "2",
                                "--no-plot", "--json"])
    assert commands.run(args) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["chips"] == list(PAPER_CHIPS)
    keys = ["data_parallel", "elastic_data_parallel", "decoupled_m2", "decoupled_m4", "decoupled_m8", "decoupled_m16"]
    assert list(payload["simulated"]) == keys and list(payload["paper"]) == keys
    assert payload["paper"]["elastic_data_parallel"] == [88, 80, 69, 58, 40]
    assert all(len(values) == 5 for values in payload["simulated"].values())


@pytest.mark.parametrize(("argv", "flag"), [(["--chips", "0"], "--chips=0"),
                                            (["--min-quorum", "9"], "--min-quorum=9"),
                                            (["--systems", "ring"], "--systems='ring'"),
                                            (["--sweep-chips", "1,x"], "--sweep-chips"),
                                            # An OverflowError traceback; a count cut to 150000 silently.
                                            (["--sweep-chips", "1e400"], "--sweep-chips='1e400' is invalid"),
                                            (["--sweep-chips", "150000.9"], "--sweep-chips='150000.9' is invalid"),
                                            (["--chips", "1000"], "--chips-per-slice=256")])
def test_cli_bad_input_names_the_flag_and_exits_2(capsys, argv, flag):
    args = parser().parse_args(["plan", "goodput", "--no-plot", *argv])
    assert commands.run(args) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
