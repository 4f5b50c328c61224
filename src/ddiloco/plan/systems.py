"""The three systems of the goodput simulator, each a function of (rng, scenario, horizon) -> totals.

What a failure costs each system (docs/planning.md derives and calibrates it):

- data_parallel (no elasticity): the whole job stops and restarts on a replacement slice
  (`restart_s`), losing the progress since its last checkpoint; a failure during a restart is
  handled by that restart.
- elastic_data_parallel: the whole job pauses to downscale (`downscale_s`), trains without the
  failed slice until it returns (exponentiated Weibull time), then pauses to upscale (`upscale_s`).
- decoupled (Decoupled DiLoCo, arXiv 2604.21428): M learners, each one an elastic job on chips / M
  chips, pausing only itself. The global model advances while at least min(K, learners present)
  learners train; below that every learner waits (K = 1: only if all of them are paused at once).

Each system is a few timelines (`ddiloco.plan.timeline`) built from the failure process
(`ddiloco.plan.failures`); totals are integrals of their products. Estimates over replicas live in
`ddiloco.plan.goodput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.plan.failures import FailureModel, poisson_times, sample_recovery_s, steady_state_down
from ddiloco.plan.scenario import LayoutConfig, ReconfigurationCosts, ScavengeConfig, Scenario
from ddiloco.plan.speed import SpeedProfile, learner_slowdowns, quorum_speed
from ddiloco.plan.timeline import (
    StepFunction,
    clip_intervals,
    coalesce_pauses,
    on_union,
    segments,
    total_length,
)


@dataclass(frozen=True)
class ReplicaSample:
    """Totals of one replica over [0, horizon_s)."""

    useful_chip_s: float
    allocated_chip_s: float
    advancing_s: float
    horizon_s: float
    tokens: float


# ---- building blocks --------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupHardware:
    """One group of chips (a learner, or a whole elastic job): its failures, returns and chips down."""

    failures_s: np.ndarray
    returns_s: np.ndarray
    down: StepFunction


def group_hardware(rng: np.random.Generator, chips: float, model: FailureModel, horizon_s: float, *,
                   on: StepFunction | None = None) -> GroupHardware:
    """Failures of `chips` chips on [0, horizon_s) and the returns of their slices.

    An always-on group starts in steady state (slices that failed before 0 and are still down,
    `steady_state_down`). A group that is only sometimes present (`on`, 0 or 1) fails only while present
    and starts with nothing down.
    """
    rate = model.failure_rate_per_s(chips)
    failures = poisson_times(rng, rate, 0.0, horizon_s)
    if on is not None:
        failures = failures[on.values_at(failures) > 0]
    returns = failures + sample_recovery_s(rng, len(failures), model)
    down_at_start, early_returns = 0, np.empty(0)
    if on is None:
        down_at_start, early_returns = steady_state_down(rng, rate, horizon_s, model)
    slice_chips = float(model.chips_per_slice)
    down = StepFunction(np.concatenate([failures, returns, early_returns]),
                        np.concatenate([np.full(len(failures), slice_chips), np.full(len(returns), -slice_chips),
                                        np.full(len(early_returns), -slice_chips)]),
                        initial=slice_chips * down_at_start)
    all_returns = np.concatenate([returns, early_returns])
    return GroupHardware(failures, np.sort(all_returns[all_returns < horizon_s]), down)


def reconfiguration_pauses(events: list[tuple[np.ndarray, float]], horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Coalesced pauses for (event times, pause seconds) pairs, clipped to [0, horizon_s)."""
    times = np.concatenate([t for t, _ in events])
    durations = np.concatenate([np.full(len(t), d) for t, d in events])
    keep = (times >= 0) & (times < horizon_s)
    times, durations = times[keep], durations[keep]
    order = np.argsort(times, kind="stable")
    starts, ends = coalesce_pauses(times[order], durations[order])
    return clip_intervals(starts, ends, 0.0, horizon_s)


def availability_windows(rng: np.random.Generator, scavenge: ScavengeConfig,
                         horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Alternating exponential windows and gaps (mean gap = window * (1 - a) / a) on [0, horizon_s)."""
    if scavenge.availability >= 1.0:
        return np.array([0.0]), np.array([horizon_s])
    gap_s = scavenge.window_s * (1.0 - scavenge.availability) / scavenge.availability
    t, on = 0.0, bool(rng.random() < scavenge.availability)
    starts, ends = [], []
    while t < horizon_s:
        length = rng.exponential(scavenge.window_s if on else gap_s)
        if on:
            starts.append(t)
            ends.append(min(t + length, horizon_s))
        t += length
        on = not on
    return np.asarray(starts), np.asarray(ends)


def running_function(pause_starts: np.ndarray, pause_ends: np.ndarray, horizon_s: float,
                     on: StepFunction | None = None) -> StepFunction:
    """1 while present (`on`) and not paused, on [0, horizon_s)."""
    paused = StepFunction.indicator(pause_starts, pause_ends)
    functions = [paused] if on is None else [paused, on]
    points, values = on_union(functions, 0.0, horizon_s)
    running = 1.0 - np.minimum(values[0], 1.0)
    if on is not None:
        running *= values[1]
    return StepFunction.from_values(np.append(points, horizon_s), np.append(running, 0.0))


def product_function(first: StepFunction, second: StepFunction, horizon_s: float) -> StepFunction:
    points, (a, b) = on_union([first, second], 0.0, horizon_s)
    return StepFunction.from_values(np.append(points, horizon_s), np.append(a * b, 0.0))


def sum_function(first: StepFunction, second: StepFunction, horizon_s: float) -> StepFunction:
    points, (a, b) = on_union([first, second], 0.0, horizon_s)
    return StepFunction.from_values(points, a + b, initial=first.initial + second.initial)


def healthy_chips(hardware: GroupHardware, chips: float) -> StepFunction:
    """chips minus the chips of the group's slices that are down, and never below 0. The failure process counts a
    failure of a chip whose slice is already down as one slice more down (the model's upper bound on chips down, which
    it shares with the paper's), so near a failure model that keeps most slices down the count passes the group's
    size at times; the chips that train then are none, not fewer than none (goodput -13 % was printed)."""
    down = hardware.down
    capped = np.minimum(down.levels, chips)
    initial = min(down.initial, chips)
    return StepFunction(down.times, -np.diff(capped, prepend=initial), initial=chips - initial)


def quorum_stalls(running: list[StepFunction], present: StepFunction, quorum: int,
                  horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Intervals in which fewer than min(quorum, learners present) learners train. The learners training are counted
    as one step function, the sum of theirs (their jumps merged), rather than as every learner's values on the union of
    all breakpoints: that array was learners x breakpoints (4.75 GiB at 20,000 learners, and a MemoryError)."""
    training = StepFunction(np.concatenate([f.times for f in running]),
                            np.concatenate([np.diff(f.levels, prepend=f.initial) for f in running]),
                            initial=sum(f.initial for f in running))
    points, (count, learners_present) = on_union([training, present], 0.0, horizon_s)
    return segments(points, count < np.minimum(quorum, learners_present), horizon_s)


def data_parallel_run(rng: np.random.Generator, chips: float, model: FailureModel, costs: ReconfigurationCosts,
                      horizon_s: float) -> tuple[float, float]:
    """(useful seconds, training seconds) of one data-parallel job without elasticity."""
    failures = poisson_times(rng, model.failure_rate_per_s(chips), 0.0, horizon_s)
    starts, ends = coalesce_pauses(failures, np.full(len(failures), costs.restart_s))
    starts, ends = clip_intervals(starts, ends, 0.0, horizon_s)
    run_starts = np.concatenate([[0.0], ends])
    run_ends = np.concatenate([starts, [horizon_s]])
    lengths = np.maximum(run_ends - run_starts, 0.0)
    training_s = float(lengths.sum())
    lost_s = 0.0
    if costs.checkpoint_interval_s > 0 and len(lengths) > 1:
        # Every run but the last ends in a failure and loses what it trained since its last checkpoint.
        lost_s = float(np.mod(lengths[:-1], costs.checkpoint_interval_s).sum())
    return training_s - lost_s, training_s


# ---- the three systems --------------------------------------------------------------------------


def _speed(rng: np.random.Generator, layout: LayoutConfig, quorum: int) -> SpeedProfile:
    slowdowns = learner_slowdowns(layout.learners, layout.slow_learner_fraction, layout.slow_learner_slowdown)
    return quorum_speed(rng, slowdowns, quorum, layout.step_time_spread)


def _extra_groups(rng: np.random.Generator, scenario: Scenario,
                  horizon_s: float) -> list[tuple[StepFunction, np.ndarray, np.ndarray]]:
    """Per extra learner: its presence indicator and its window starts and ends."""
    out = []
    for _ in range(scenario.scavenge.extra_learners):
        starts, ends = availability_windows(rng, scenario.scavenge, horizon_s)
        out.append((StepFunction.indicator(starts, ends), starts, ends))
    return out


def simulate_data_parallel(rng: np.random.Generator, scenario: Scenario, horizon_s: float) -> ReplicaSample:
    """One job on every chip; it cannot change size, so scavenged chips stay unused."""
    layout = scenario.layout
    speed = _speed(rng, layout, layout.learners)
    useful_s, training_s = data_parallel_run(rng, layout.chips, scenario.failures, scenario.costs, horizon_s)
    useful = layout.chips * useful_s
    return ReplicaSample(useful * float(speed.busy_fraction.mean()), layout.chips * horizon_s, useful_s,
                         horizon_s, useful * float(speed.rate.mean()) * layout.tokens_per_chip_s)


def simulate_elastic(rng: np.random.Generator, scenario: Scenario, horizon_s: float) -> ReplicaSample:
    """One elastic job: every failure, return, join and departure of chips pauses all of it."""
    layout, model, costs = scenario.layout, scenario.failures, scenario.costs
    speed = _speed(rng, layout, layout.learners)
    base = group_hardware(rng, layout.chips, model, horizon_s)
    events = [(base.failures_s, costs.downscale_s), (base.returns_s, costs.upscale_s)]
    capacity = healthy_chips(base, layout.chips)
    allocated = layout.chips * horizon_s
    for on, starts, ends in _extra_groups(rng, scenario, horizon_s):
        extra = group_hardware(rng, layout.chips_per_learner, model, horizon_s, on=on)
        returns = extra.returns_s[on.values_at(extra.returns_s) > 0]
        events += [(extra.failures_s, costs.downscale_s), (returns, costs.upscale_s),
                   (starts[starts > 0], costs.upscale_s), (ends[ends < horizon_s], costs.downscale_s)]
        extra_capacity = product_function(on, healthy_chips(extra, layout.chips_per_learner), horizon_s)
        capacity = sum_function(capacity, extra_capacity, horizon_s)
        allocated += layout.chips_per_learner * total_length(starts, ends)
    pause_starts, pause_ends = reconfiguration_pauses(events, horizon_s)
    running = running_function(pause_starts, pause_ends, horizon_s)
    useful = product_function(running, capacity, horizon_s).integral(np.array([0.0]), np.array([horizon_s]))
    advancing = horizon_s - total_length(pause_starts, pause_ends)
    return ReplicaSample(useful * float(speed.busy_fraction.mean()), allocated, advancing, horizon_s,
                         useful * float(speed.rate.mean()) * layout.tokens_per_chip_s)


def simulate_decoupled(rng: np.random.Generator, scenario: Scenario, horizon_s: float) -> ReplicaSample:
    """M learners, each an elastic job of chips / M chips that pauses only itself."""
    layout, model, costs = scenario.layout, scenario.failures, scenario.costs
    speed = _speed(rng, layout, layout.min_quorum)
    chips = layout.chips_per_learner
    running, work, busy, rate = [], [], [], []
    allocated = layout.chips * horizon_s
    present = StepFunction(np.empty(0), np.empty(0), initial=float(layout.learners))
    for m in range(layout.learners):
        hardware = group_hardware(rng, chips, model, horizon_s)
        starts, ends = reconfiguration_pauses([(hardware.failures_s, costs.downscale_s),
                                               (hardware.returns_s, costs.upscale_s)], horizon_s)
        running.append(running_function(starts, ends, horizon_s))
        work.append(healthy_chips(hardware, chips))
        busy.append(speed.busy_fraction[m])
        rate.append(speed.rate[m])
    for on, win_starts, win_ends in _extra_groups(rng, scenario, horizon_s):
        # A learner already present at t = 0 has joined before the measured window: no join pause.
        hardware = group_hardware(rng, chips, model, horizon_s, on=on)
        starts, ends = reconfiguration_pauses([(hardware.failures_s, costs.downscale_s),
                                               (hardware.returns_s, costs.upscale_s),
                                               (win_starts[win_starts > 0], costs.join_s)], horizon_s)
        running.append(running_function(starts, ends, horizon_s, on=on))
        work.append(healthy_chips(hardware, chips))
        # Scavenged learners run at nominal speed; only the base layout is heterogeneous.
        busy.append(1.0)
        rate.append(1.0)
        present = sum_function(present, on, horizon_s)
        allocated += chips * total_length(win_starts, win_ends)
    stall_starts, stall_ends = quorum_stalls(running, present, layout.min_quorum, horizon_s)
    useful_total = tokens = 0.0
    for run, healthy, b, r in zip(running, work, busy, rate, strict=True):
        useful_chip_s = product_function(run, healthy, horizon_s)
        useful = useful_chip_s.integral(np.array([0.0]), np.array([horizon_s]))
        useful -= useful_chip_s.integral(stall_starts, stall_ends)
        useful_total += useful * b
        tokens += useful * r * layout.tokens_per_chip_s
    advancing = horizon_s - total_length(stall_starts, stall_ends)
    return ReplicaSample(useful_total, allocated, advancing, horizon_s, tokens)


SIMULATORS = {
    "data_parallel": simulate_data_parallel,
    "elastic_data_parallel": simulate_elastic,
    "decoupled": simulate_decoupled,
}
