"""Plan input that must be refused up front, in one message naming the file, the fault and the bound: parameters
and times too large (or a bandwidth too small) for the run, duplicate keys, a `faults` or `seed` of the wrong
kind, outages that overlap, a `--duration` the plan's faults do not fit; and YAML numbers with an exponent,
which load as numbers. Also: a control file written by hand with such values neither crashes nor wedges the
process that reads it."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import yaml

from ddiloco.chaos.plan import load_plan, model_plan, quick_plan, soak_plan
from ddiloco.fault_control import MAX_RUN_S, MAX_SLOWDOWN, ActiveFault, ChaosControl, write_control
from ddiloco.run_config import MAX_SEED

EXAMPLE = Path(__file__).parents[2] / "examples" / "chaos_plan.yaml"


def _write(tmp_path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _refusal(tmp_path, text: str, name: str = "plan.yaml", num_learners: int = 2, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        load_plan(_write(tmp_path, text, name), num_learners, **kwargs)
    return str(error.value)


def _one_fault(fault: str, duration: str = "30s") -> str:
    return f"duration: {duration}\nfaults:\n  - {{at: 1s, kind: crash, target: 0}}\n  - {fault}\n"


# ---- extreme values ----

@pytest.mark.parametrize(("fault", "words"), [
    ("{at: 3s, kind: latency, target: 0, duration: 5s, latency: 1.0e+300}",
     ["plan.yaml, fault 1: latency=1e+300", "30"]),
    ("{at: 3s, kind: latency, target: 0, duration: 5s, latency: 31s}", ["plan.yaml, fault 1: latency=31", "30"]),
    ("{at: 3s, kind: bandwidth, target: 0, duration: 5s, bandwidth: 1.0e-300}",
     ["plan.yaml, fault 1: bandwidth=1e-300", "33333.3", "1 MB"]),
    ("{at: 3s, kind: bandwidth, target: 0, duration: 5s, bandwidth: 1kb}", ["plan.yaml, fault 1: bandwidth=1000"]),
    ("{at: 3s, kind: straggler, target: 0, duration: 5s, factor: 1.0e+300}",
     ["plan.yaml, fault 1: factor=1e+300", f"{MAX_SLOWDOWN:g}"]),
    ("{at: 3s, kind: straggler, target: 0, duration: 5s, factor: 101}", ["plan.yaml, fault 1: factor=101"]),
    ("{at: 3s, kind: hang, target: 0, duration: 1.0e+30}", ["plan.yaml, fault 1: duration", f"{MAX_RUN_S:g}"]),
])
def test_a_value_beyond_its_bound_is_refused_naming_file_fault_and_bound(tmp_path, fault, words):
    message = _refusal(tmp_path, _one_fault(fault))
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("duration", ["1.0e+30", f"{MAX_RUN_S + 1:g}s", "1e30"])
def test_a_plan_duration_beyond_a_week_is_refused(tmp_path, duration):
    message = _refusal(tmp_path, f"duration: {duration}\nfaults: []\n")
    assert message.startswith("plan.yaml: duration") and f"{MAX_RUN_S:g}" in message, message


def test_values_at_their_bounds_are_accepted(tmp_path):
    plan = load_plan(_write(tmp_path, (
        "duration: 30s\nfaults:\n"
        "  - {at: 1s, kind: latency, target: 0, duration: 5s, latency: 30s}\n"
        f"  - {{at: 1s, kind: straggler, target: 1, duration: 5s, factor: {MAX_SLOWDOWN:g}}}\n"
        "  - {at: 1s, kind: bandwidth, target: 1, duration: 5s, bandwidth: 33334}\n")), 2)
    assert sorted(f.value for f in plan.faults) == [30.0, MAX_SLOWDOWN, 33334.0]


@pytest.mark.parametrize(("kind", "value"), [("latency", 1e300), ("bandwidth", 1e-300), ("straggler", 1e300)])
def test_a_control_file_written_by_hand_with_an_extreme_value_is_ignored_with_a_warning(tmp_path, caplog, kind,
                                                                                         value):
    param = {"latency": "latency_s", "bandwidth": "bytes_per_s", "straggler": "factor"}[kind]
    path = tmp_path / "chaos.json"
    path.write_text(json.dumps({"faults": [{"kind": kind, "until": time.time() + 60, param: value}]}))
    control = ChaosControl(path, refresh_s=0.0)
    with caplog.at_level(logging.WARNING, logger="ddiloco.fault_control"):
        assert (control.extra_latency_s(), control.bandwidth_bytes_per_s(), control.slowdown()) == (0.0, None, 1.0)
    assert str(path) in caplog.text and param in caplog.text
    with pytest.raises(ValueError, match=param):
        ActiveFault(kind, time.time() + 60, value)


def test_a_control_file_at_the_bounds_is_obeyed(tmp_path):
    path = tmp_path / "chaos.json"
    until = time.time() + 60
    write_control(path, [ActiveFault("straggler", until, MAX_SLOWDOWN), ActiveFault("latency", until, MAX_RUN_S)])
    control = ChaosControl(path, refresh_s=0.0)
    assert (control.slowdown(), control.extra_latency_s()) == (MAX_SLOWDOWN, MAX_RUN_S)


class _SlowControl:
    """A control whose fault asks a data-parallel rank for a sleep far beyond what time.sleep accepts."""

    def slowdown(self) -> float:
        return 1e300

    def extra_latency_s(self) -> float:
        return 0.0

    def bandwidth_bytes_per_s(self) -> float | None:
        return None


def test_a_data_parallel_rank_slowed_beyond_any_sleep_neither_overflows_nor_outlives_a_stop():
    from ddiloco.chaos.dp_worker import DataParallelRank

    rank = DataParallelRank.__new__(DataParallelRank)  # only the fields the emulation reads
    rank.control, rank.world_size, rank.grad_bytes, rank.stop_requested = _SlowControl(), 2, 1000, True
    started = time.monotonic()
    rank._emulate_slow_rank_and_link(compute_s=0.1)
    assert time.monotonic() - started < 1.0


# ---- YAML numbers with an exponent ----

@pytest.mark.parametrize("factor", ["1e1", "1.0e1", "1e+1", "1E1", "1.0e+1", "100e-1", "1.e1"])
def test_a_yaml_number_with_an_exponent_is_a_number_in_every_spelling(tmp_path, factor):
    plan = load_plan(_write(tmp_path, _one_fault(f"{{at: 2e0, kind: straggler, target: 0, duration: 5s, "
                                                 f"factor: {factor}}}")), 2)
    assert [(f.at_s, f.value) for f in plan.faults if f.kind == "straggler"] == [(2.0, 10.0)]
    assert yaml.safe_load("x: 1e3") == {"x": "1e3"}  # the plan's loader leaves PyYAML's own as it was


def test_a_number_written_as_text_gets_a_hint_that_fits_it(tmp_path):
    message = _refusal(tmp_path, _one_fault('{at: 2s, kind: straggler, target: 0, duration: 5s, factor: "3"}'))
    assert "plan.yaml, fault 1: factor '3' is invalid for straggler: it is not a number" in message, message
    assert "quotes" in message and "YAML reads" not in message, message


# ---- errors that name the file, the faults and where the limit came from ----

def test_a_duration_given_instead_of_the_plans_names_the_file_the_fault_and_its_source():
    with pytest.raises(ValueError) as error:
        load_plan(EXAMPLE, 4, duration_s=10.0)
    message = str(error.value)
    assert message.startswith("chaos_plan.yaml, fault 0: at=15s is not before --duration 10s"), message
    assert "plan's duration" not in message


def test_a_duration_given_instead_of_the_plans_runs_the_plan_for_it():
    assert load_plan(EXAMPLE, 4, duration_s=110.0).duration_s == 110.0
    assert quick_plan(2, duration_s=35.0).duration_s == 35.0
    with pytest.raises(ValueError, match=r"^the --quick plan, fault 1: at=10s is not before --duration 9s"):
        quick_plan(2, duration_s=9.0)
    with pytest.raises(ValueError, match=r"^--duration 1e\+30 is invalid"):
        load_plan(EXAMPLE, 4, duration_s=1e30)


def test_a_duration_given_instead_of_the_plans_bounds_the_values_too(tmp_path):
    text = "duration: 60s\nfaults:\n  - {at: 1s, kind: latency, target: 0, duration: 5s, latency: 20s}\n"
    message = _refusal(tmp_path, text, duration_s=10.0)
    assert message.startswith("plan.yaml, fault 0: latency=20") and "--duration 10s" in message, message


def test_overlapping_outages_of_one_learner_name_the_file_and_both_faults(tmp_path):
    text = ("duration: 30s\nfaults:\n  - {at: 1s, kind: crash, target: 0}\n"
            "  - {at: 5s, kind: crash, target: learner-1, restart: false, duration: 5s}\n"
            "  - {at: 8s, kind: crash, target: learner-1, restart: false, duration: 5s}\n")
    message = _refusal(tmp_path, text)
    assert message.startswith("plan.yaml: faults 1 and 2 overlap"), message
    assert "learner-1" in message and "merge" in message, message


# ---- accepted silently before ----

@pytest.mark.parametrize(("text", "name", "words"), [
    ("duration: 30s\nduration: 5s\nfaults: []\n", "plan.yaml",
     ["plan.yaml: line 2: key 'duration' appears twice", "first on line 1"]),
    ("duration: 30s\nfaults:\n  - {at: 1s, kind: crash, target: 0, at: 2s}\n", "plan.yaml",
     ["plan.yaml", "line 3", "'at'", "twice"]),
    ('{"duration": "30s", "faults": [], "duration": "5s"}', "plan.json", ["plan.json", "'duration'", "twice"]),
    ("duration: 30s\nfaults: false\n", "plan.yaml", ["plan.yaml: faults is invalid", "list", "not False"]),
    ("duration: 30s\nfaults: 0\n", "plan.yaml", ["plan.yaml: faults is invalid", "list", "not 0"]),
    ("duration: 30s\nfaults: ''\n", "plan.yaml", ["plan.yaml: faults is invalid", "list", "not ''"]),
    ("duration: 30s\nseed: -7\nfaults: []\n", "plan.yaml", ["plan.yaml: seed -7 is invalid", str(MAX_SEED)]),
    ("duration: 30s\nseed: 99999999999999999999999999\nfaults: []\n", "plan.yaml",
     ["plan.yaml: seed 99999999999999999999999999 is invalid", str(MAX_SEED)]),
])
def test_input_accepted_silently_before_is_refused(tmp_path, text, name, words):
    message = _refusal(tmp_path, text, name)
    for word in words:
        assert word in message, message


def test_no_faults_key_or_an_empty_one_is_a_plan_without_faults(tmp_path):
    assert load_plan(_write(tmp_path, "duration: 30s\n"), 2).faults == ()
    assert load_plan(_write(tmp_path, "duration: 30s\nfaults:\nseed: 3\n"), 2).faults == ()
    assert load_plan(_write(tmp_path, f"duration: 30s\nseed: {MAX_SEED}\n"), 2).seed == MAX_SEED


@pytest.mark.parametrize("draw", [
    lambda: quick_plan(2, duration_s=float("nan")),
    lambda: soak_plan(1e30, 2, kill_every_s=10.0, seed=0),
    lambda: model_plan(1e30, 2, mtbi_per_chip_s=10.0, chips_per_learner=1, seed=0),
])
def test_a_drawn_or_quick_plan_longer_than_a_week_is_refused_before_drawing(draw):
    with pytest.raises(ValueError, match=f"{MAX_RUN_S:g}"):
        draw()
