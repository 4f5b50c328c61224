"""The goodput simulator at the edges: cluster sizes far past a million chips, shares near 0.

`plan goodput --chips 1e12` once allocated 23 GiB (a warm-up of 3e9 failures drawn before t = 0) and was killed;
`--chips 1e22` ended in NumPy's "lam value too large"; and at 1e10 chips the 95 % intervals of goodput and uptime
reached below 0."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from ddiloco.cli import main
from ddiloco.plan.failures import MAX_SLICES_DOWN, FailureModel, max_chips, steady_state_down
from ddiloco.plan.goodput import SYSTEMS, Estimate, horizon_for, simulate
from ddiloco.plan.scenario import LayoutConfig, ReconfigurationCosts, Scenario, SimulationConfig
from ddiloco.plan.systems import group_hardware, healthy_chips, quorum_stalls
from ddiloco.plan.timeline import StepFunction

EXIT_USAGE = 2
SMALL = SimulationConfig(failures=200, replicas=2, seed=3)
BOUNDED_BYTES = 32 * 2**20
"""Peak memory the simulator may trace at any cluster size with SMALL: its draws are of the order of the
failures inside the horizon (200), not of the chips; the old warm-up needed ~1 GB at 1e10 chips."""


@pytest.mark.parametrize("chips", [10**10, 10**15])
def test_memory_does_not_grow_with_the_chip_count(chips):
    scenario = Scenario(layout=LayoutConfig(chips=chips, learners=2))
    tracemalloc.start()
    try:
        for system in SYSTEMS:
            simulate(system, scenario, SMALL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BOUNDED_BYTES, f"{peak / 2**20:.0f} MiB at {chips:.0e} chips"


@pytest.mark.parametrize("chips", [1_200_000, 10**12])
def test_the_slices_down_at_the_start_are_in_steady_state(chips):
    # Little's law: on average rate * mean recovery slices are down at any time, t = 0 included; and every
    # return inside the horizon is one of those slices coming back (intensity rate * P(recovery > t)).
    model = FailureModel()
    rate = model.failure_rate_per_s(chips)
    horizon_s = horizon_for(Scenario(layout=LayoutConfig(chips=chips)), SimulationConfig())
    draws = [steady_state_down(np.random.default_rng(seed), rate, horizon_s, model) for seed in range(400)]
    down = np.array([count for count, _ in draws], dtype=np.float64)
    expected = rate * model.recovery_mean_s()
    # 400 Poisson draws: the mean's standard deviation is sqrt(expected / 400), under 0.6 % of 136 here.
    assert down.mean() == pytest.approx(expected, rel=0.03)
    back = np.array([len(returns) for _, returns in draws], dtype=np.float64)
    x = np.linspace(0.0, min(horizon_s, 60 * model.recovery_scale_s), 100_001)
    s = 1.0 - model.recovery_cdf(x)
    assert back.mean() == pytest.approx(rate * float(np.sum((s[1:] + s[:-1]) * np.diff(x)) / 2), rel=0.03)
    assert all(np.all(np.diff(r) >= 0) and (len(r) == 0 or (r[0] >= 0 and r[-1] < horizon_s)) for _, r in draws)
    assert np.all(back <= down)


def test_a_group_of_a_trillion_chips_has_about_the_lost_capacity_down():
    model = FailureModel()
    chips = 10**12
    hardware = group_hardware(np.random.default_rng(0), chips, model, 1.0)
    assert hardware.down.initial / chips == pytest.approx(model.lost_capacity_fraction(), rel=1e-3)


def test_the_largest_cluster_runs_and_one_more_chip_is_refused_in_one_line(capsys):
    model = FailureModel()
    most = int(max_chips(model))
    assert most == pytest.approx(MAX_SLICES_DOWN * model.mtbi_s / model.recovery_mean_s(), rel=1e-4)
    for system in SYSTEMS:
        result = simulate(system, Scenario(layout=LayoutConfig(chips=most, learners=2)), SMALL)
        assert 0.0 <= result.goodput.low <= result.goodput.mean <= result.goodput.high <= 1.0
    assert main(["plan", "goodput", "--chips", str(most + 10**9), "--no-plot"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"--chips={most + 10**9} is invalid: expected at most {most:.3g} chips" in err


def test_a_failure_model_that_downs_more_slices_lowers_the_limit():
    flaky = FailureModel(mtbi_s=1.0)
    with pytest.raises(ValueError, match="^chips=10000000000000000 is invalid"):
        Scenario(layout=LayoutConfig(chips=10**16), failures=flaky)
    assert max_chips(flaky) < 10**15 < max_chips(FailureModel())


# ---- intervals of shares ----------------------------------------------------------------------------------------


def test_an_interval_is_cut_to_the_values_the_quantity_can_take():
    # Student t with 2 degrees of freedom: mean 1/3000, half-width 4.303 * sd / sqrt(3), past 0 unless cut.
    values = np.array([0.0, 0.0, 0.001])
    free = Estimate.of(values)
    assert free.low < 0
    share = Estimate.of(values, lowest=0.0, highest=1.0)
    assert (share.mean, share.low, share.high) == (free.mean, 0.0, free.high)
    near_one = Estimate.of(1.0 - values, lowest=0.0, highest=1.0)
    assert near_one.high == 1.0 and near_one.low == pytest.approx(1.0 - free.high)


def test_simulated_goodput_uptime_and_tokens_stay_within_their_ranges():
    # A downscale of a day: the first failure pauses the elastic job for the rest of the horizon, so uptime is the
    # first failure's time over the horizon, near 0 and spread over replicas.
    scenario = Scenario(costs=ReconfigurationCosts(downscale_s=86_400.0, upscale_s=86_400.0))
    result = simulate("elastic_data_parallel", scenario, SimulationConfig(failures=10, replicas=2, seed=0))
    for estimate in (result.goodput, result.uptime):
        assert 0.0 <= estimate.low <= estimate.mean <= estimate.high <= 1.0, estimate
    assert 0.0 <= result.tokens_per_hour.low <= result.tokens_per_hour.mean


@pytest.mark.parametrize("flags", [("--chips", "1200000", "--chips-per-slice", "10000"), ("--mtbi-s", "100000")])
def test_a_failure_model_that_keeps_more_chips_down_than_there_are_is_refused(capsys, flags):
    # Before: printed as results, exit 0: Decoupled -13.3 % and -5.8e11 tokens an hour at 10,000 chips a slice
    # (each chip failure takes 10,000 chips down for 3,586 s on average, one chip in a year: 1.14 slices down per
    # slice), -26.2 % at an MTBI of 100,000 s.
    assert main(["plan", "goodput", *flags, "--no-plot"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "keeps more chips down than the cluster has" in err and "--chips-per-slice" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_chips_down_are_never_more_than_the_group_has():
    # Below that bound the count still passes the group's size at times: a chip whose slice is already down fails
    # again and takes a slice more down (the model's upper bound). The healthy chips stop at 0 instead of below.
    model = FailureModel(chips_per_slice=8000)  # 0.91 slices down per slice on average: 136 of 150
    chips = 1_200_000
    hardware = group_hardware(np.random.default_rng(0), chips, model, 3e5)
    assert hardware.down.levels.max() > chips  # what the model draws here: more than every chip down at times
    healthy = healthy_chips(hardware, chips)
    assert healthy.levels.min() == 0.0 and healthy.initial >= 0.0
    assert np.array_equal(healthy.levels, chips - np.minimum(hardware.down.levels, chips))
    result = simulate("decoupled", Scenario(layout=LayoutConfig(chips=chips, learners=8), failures=model), SMALL)
    assert 0.0 <= result.goodput.mean <= 1.0 and result.tokens_per_hour.mean >= 0.0, result


def test_quorum_stalls_take_memory_of_the_events_not_of_learners_times_events():
    # Before: every learner's values on the union of all breakpoints, a learners x breakpoints array: 640 MB here,
    # 4.75 GiB (a MemoryError) for `plan goodput --chips 1e7 --learners 20000`.
    rng = np.random.default_rng(5)
    learners, pauses, horizon_s = 2000, 10, 1e6
    running = []
    for _ in range(learners):
        starts = np.sort(rng.uniform(0.0, horizon_s, pauses))
        running.append(StepFunction.from_values(np.concatenate([[0.0], starts, starts + 10.0]),
                                                np.concatenate([[1.0], np.zeros(pauses), np.ones(pauses)]),
                                                initial=1.0))
    present = StepFunction(np.array([]), np.array([]), initial=float(learners))
    tracemalloc.start()
    try:
        starts, ends = quorum_stalls(running, present, learners, horizon_s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BOUNDED_BYTES, f"{peak / 2**20:.0f} MiB"
    # With the quorum at every learner, training stalls whenever any learner pauses: the union of the pauses.
    pauses_from = np.sort(np.concatenate([f.times[f.levels == 0.0] for f in running]))
    union, end = 0.0, -np.inf
    for start in pauses_from:  # merged by hand: each pause lasts 10 s
        union += 10.0 - max(0.0, min(end - start, 10.0))
        end = max(end, start + 10.0)
    assert starts[0] == pauses_from[0] and np.all(ends > starts)
    assert float(np.sum(ends - starts)) == pytest.approx(union, rel=1e-9)


@pytest.mark.parametrize(("argv", "needle"), [
    # Before: "lam value too large" and "lam < 0 or lam is NaN" (NumPy's words, no flag), after two RuntimeWarnings.
    (("goodput", "--mtbi-s", "1e308", "--chips", "1", "--learners", "1", "--chips-per-slice", "1"),
     "--mtbi-s=1e+308 is invalid"),
    (("goodput", "--recovery-scale-s", "1e307"), "--recovery-scale-s=1e+307 is invalid"),
    # Before: printed as results, exit 0, and as `Infinity` / `NaN` in the JSON, which strict parsers refuse.
    (("goodput", "--tokens-per-chip-s", "1e308"), "tokens_per_hour.mean = inf, not a finite number"),
    (("bandwidth", "--step-time-s", "1e-300"), "up_gbps = inf, not a finite number"),
])
def test_inputs_at_the_edges_of_float64_are_refused_in_one_line_naming_what(capsys, argv, needle):
    assert main(["plan", *argv, "--no-plot", "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert needle in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "Warning" not in captured.err and "Infinity" not in captured.out, captured


@pytest.mark.parametrize(("argv", "needle"), [
    # Before: 1e12 failures asked NumPy for 7.28 TiB; a window of a microsecond ran for minutes into gigabytes.
    (("goodput", "--failures", "1000000000000"), "--failures=1000000000000 is invalid"),
    (("goodput", "--scavenge-extra-learners", "1", "--scavenge-window-s", "1e-6"), "--scavenge-window-s=1e-06"),
    # Before: ignored without a word, while --chips 5 still refused the grid as a layout of 5 chips.
    (("goodput", "--paper-grid", "--systems", "decoupled", "--chips", "5"), "drop --chips, --systems"),
    # Before: 1e14 fragments of 12e9 parameters needed 83,333 Gbps (a value counted per fragment).
    (("bandwidth", "--num-fragments", "100000000000000"), "--num-fragments=100000000000000 is invalid"),
])
def test_work_without_bound_and_flags_without_effect_are_refused_in_one_line(capsys, argv, needle):
    assert main(["plan", *argv, "--no-plot"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
