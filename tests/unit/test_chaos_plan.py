"""Fault plans: the user format and its errors, the JSON round trip, the failure model, the quick plan."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ddiloco.chaos.plan import KINDS, Fault, FaultPlan, load_plan, model_plan, quick_plan

EXAMPLE = """\
duration: 120s
faults:
  - {at: 20s, kind: crash, target: learner-1}
  - {at: 30s, kind: crash, target: learner-2, restart: false, duration: 15s}
  - {at: 40s, kind: hang, target: learner-2, duration: 15s}
  - {at: 50s, kind: straggler, target: learner-0, duration: 20s, factor: 3}
  - {at: 60s, kind: partition, target: learner-0, duration: 20s}
  - {at: 70s, kind: latency, target: learner-3, duration: 20s, latency: 200ms}
  - {at: 75s, kind: bandwidth, target: 3, duration: 0.5min, bandwidth: 10mbit}
  - {at: 80s, kind: drop, target: learner-1, duration: 10s, probability: 0.5}
  - {at: 85s, kind: corrupt, target: learner-1, duration: 10s, probability: 0.5}
  - {at: 90, kind: syncer_crash}
"""


def write(tmp_path, text: str, name: str = "plan.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_example_plan_parses_every_kind_with_units(tmp_path):
    plan = load_plan(write(tmp_path, EXAMPLE), num_learners=4)
    assert plan.duration_s == 120.0 and plan.num_learners == 4
    assert [f.kind for f in plan.faults] == ["crash", "crash", "hang", "straggler", "partition", "latency",
                                             "bandwidth", "drop", "corrupt", "syncer_crash"]
    by_kind = {f.kind: f for f in plan.faults}
    assert plan.faults[0] == Fault(at_s=20.0, kind="crash", target=1)
    assert plan.faults[1] == Fault(at_s=30.0, kind="crash", target=2, restart=False, duration_s=15.0)
    assert by_kind["straggler"].value == 3.0
    assert by_kind["latency"].value == pytest.approx(0.2)
    assert by_kind["bandwidth"].value == pytest.approx(10e6 / 8) and by_kind["bandwidth"].duration_s == 30.0
    assert by_kind["drop"].value == 0.5 and by_kind["syncer_crash"].target is None
    assert by_kind["syncer_crash"].at_s == 90.0


def test_faults_are_sorted_by_start_and_json_round_trips(tmp_path):
    text = "duration: 60\nseed: 7\nfaults:\n  - {at: 30s, kind: hang, target: 0, duration: 5s}\n" \
           "  - {at: 10s, kind: crash, target: 1}\n"
    plan = load_plan(write(tmp_path, text), num_learners=2)
    assert [f.at_s for f in plan.faults] == [10.0, 30.0] and plan.seed == 7
    saved = plan.save(tmp_path / "out" / "plan.json")
    again = FaultPlan.from_json(json.loads(saved.read_text()))
    assert again == plan and again.source == plan.source
    json_plan = load_plan(write(tmp_path, json.dumps({"duration": "1min", "faults": [
        {"at": "500ms", "kind": "syncer_crash", "target": "syncer"}]}), "plan.json"), num_learners=2)
    assert json_plan.duration_s == 60.0 and json_plan.faults[0].at_s == 0.5


@pytest.mark.parametrize(("fault", "message"), [
    ("{at: 1s, kind: crsh, target: 0}", "plan.yaml, fault 1: kind 'crsh' is unknown: expected one of crash, hang"),
    ("{at: 1s, kind: crash, target: 0, color: red}", "plan.yaml, fault 1: unknown key 'color'"),
    ("{at: 1s, kind: crash, target: learner-5}", "plan.yaml, fault 1: target learner-5 is beyond the run's 2"),
    ("{at: 1s, kind: crash, target: syncer}", "plan.yaml, fault 1: target 'syncer' is invalid for crash"),
    ("{at: 1s, kind: syncer_crash, target: learner-0}", "plan.yaml, fault 1: target 'learner-0' is invalid"),
    ("{at: 90s, kind: crash, target: 0}", "plan.yaml, fault 1: at=90s is not before the plan's duration"),
    ("{at: soon, kind: crash, target: 0}", "plan.yaml, fault 1: at 'soon' is invalid"),
    ("{kind: crash, target: 0}", "plan.yaml, fault 1: at is missing"),
    ("{at: 1s, target: 0}", "plan.yaml, fault 1: kind is missing"),
    ("{at: 1s, kind: crash}", "plan.yaml, fault 1: target is missing for crash"),
    ("{at: 1s, kind: hang, target: 0}", "plan.yaml, fault 1: duration is missing for hang"),
    ("{at: 1s, kind: crash, target: 0, restart: false}", "fault 1: duration is missing for crash with restart"),
    ("{at: 1s, kind: crash, target: 0, duration: 5s}", "fault 1: duration=5.0 is invalid for an instantaneous"),
    ("{at: 1s, kind: hang, target: 0, duration: 5s, restart: false}", "fault 1: restart=false is invalid for hang"),
    ("{at: 1s, kind: crash, target: 0, restart: maybe}", "fault 1: restart 'maybe' is invalid"),
    ("{at: 1s, kind: straggler, target: 0, duration: 5s}", "fault 1: factor is missing for straggler"),
    ("{at: 1s, kind: straggler, target: 0, duration: 5s, factor: 0.5}", "fault 1: factor=0.5 is invalid"),
    ("{at: 1s, kind: drop, target: 0, duration: 5s, probability: 1.5}", "fault 1: probability=1.5 is invalid"),
    ("{at: 1s, kind: drop, target: 0, duration: 5s, factor: 2}", "fault 1: factor is invalid for drop"),
    ("{at: 1s, kind: latency, target: 0, duration: 5s, latency: fast}", "fault 1: latency 'fast' is invalid"),
    ("{at: 1s, kind: bandwidth, target: 0, duration: 5s, bandwidth: 10parsecs}", "fault 1: bandwidth '10parsecs'"),
    ("{at: 1s, kind: partition, target: 0, duration: 5s, probability: 0.1}", "fault 1: probability is invalid for"),
    ("[1, 2]", "plan.yaml, fault 1: [1, 2] is invalid: expected a mapping"),
])
def test_each_bad_fault_is_refused_naming_file_index_and_field(tmp_path, fault, message):
    text = f"duration: 60s\nfaults:\n  - {{at: 0s, kind: crash, target: 0}}\n  - {fault}\n"
    with pytest.raises(ValueError) as error:
        load_plan(write(tmp_path, text), num_learners=2)
    assert message in str(error.value)


@pytest.mark.parametrize(("text", "message"), [
    ("faults: []\n", "plan.yaml: duration is missing"),
    ("duration: -5s\nfaults: []\n", "plan.yaml: duration '-5s' is invalid"),
    ("duration: 0\nfaults: []\n", "plan.yaml: duration 0 is invalid"),
    ("duration: 60s\nfault: []\n", "plan.yaml: unknown key 'fault'"),
    ("duration: 60s\nfaults: {at: 1}\n", "plan.yaml: faults is invalid: expected a list"),
    ("duration: 60s\nseed: one\n", "plan.yaml: seed 'one' is invalid"),
    ("- 1\n- 2\n", "plan.yaml: expected a mapping"),
    ("duration: [\n", "plan.yaml: not valid YAML"),
])
def test_bad_plan_files_are_refused_with_the_file_and_field(tmp_path, text, message):
    with pytest.raises(ValueError, match=None) as error:
        load_plan(write(tmp_path, text), num_learners=2)
    assert message in str(error.value)


def test_unknown_format_and_missing_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown plan format '.toml'"):
        load_plan(write(tmp_path, "x", "plan.toml"), num_learners=2)
    with pytest.raises(ValueError, match="cannot read the fault plan"):
        load_plan(tmp_path / "absent.yaml", num_learners=2)


def test_model_plan_is_seeded_and_fails_at_the_configured_rate():
    args = dict(duration_s=10_000.0, num_learners=8, mtbi_per_chip_s=400.0, chips_per_learner=4,
                max_recovery_s=1.0)
    plan = model_plan(**args, seed=3)
    assert plan == model_plan(**args, seed=3)
    assert plan != model_plan(**args, seed=4)
    assert all(f.kind == "crash" and not f.restart and 0 < f.duration_s <= 1.0 for f in plan.faults)
    assert all(10.0 <= f.at_s <= 10_000.0 - 10.0 for f in plan.faults)
    # rate = chips / mtbi = 0.01 per second per learner, over a window of 9980 s: about 100 each.
    expected = 8 * 9_980.0 * 4 / 400.0
    assert abs(len(plan.faults) - expected) < 4 * math.sqrt(expected)
    assert plan.model["chips_per_learner"] == 4 and plan.source == "model"
    assert FaultPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_model_plan_never_takes_every_learner_down_at_once():
    plan = model_plan(300.0, 2, mtbi_per_chip_s=20.0, chips_per_learner=1, seed=0, recovery_scale_s=30.0)
    assert len(plan.faults) > 2
    for fault in plan.faults:
        down = [f for f in plan.faults if f.at_s <= fault.at_s < f.end_s]
        assert len(down) <= 1, down


def test_model_plan_draws_other_kinds_by_weight():
    plan = model_plan(2_000.0, 4, mtbi_per_chip_s=50.0, chips_per_learner=1, seed=1,
                      kind_weights={"straggler": 1.0, "drop": 1.0})
    kinds = {f.kind for f in plan.faults}
    assert kinds == {"straggler", "drop"}
    assert all(f.value is not None and f.duration_s > 0 for f in plan.faults)
    with pytest.raises(ValueError, match="kind_weights: kind 'syncer_crash' is invalid"):
        model_plan(100.0, 2, 50.0, 1, 0, kind_weights={"syncer_crash": 1.0})
    with pytest.raises(ValueError, match="margin_s=90 is invalid"):
        model_plan(100.0, 2, 50.0, 1, 0, margin_s=90)


@pytest.mark.parametrize("num_learners", [2, 3, 4, 8])
def test_quick_plan_has_every_kind_but_bandwidth_within_32_s(num_learners):
    plan = quick_plan(num_learners)
    assert plan.duration_s == 40.0
    assert {f.kind for f in plan.faults} == set(KINDS) - {"bandwidth"}
    assert {f.restart for f in plan.faults if f.kind == "crash"} == {True, False}
    assert max(f.end_s for f in plan.faults) <= 32.0
    assert all(f.target is None or f.target < num_learners for f in plan.faults)
    if num_learners == 2:  # a partner is always healthy while a learner is crashed, hung or partitioned
        for fault in plan.faults:
            if fault.kind in ("crash", "hang", "partition"):
                others = [f for f in plan.faults if f.target not in (None, fault.target)
                          and f.kind in ("crash", "hang", "partition") and f.at_s < max(fault.end_s, fault.at_s + 1)
                          and fault.at_s < f.end_s]
                assert not others, (fault, others)
    with pytest.raises(ValueError, match="num_learners=1 is invalid for the quick plan"):
        quick_plan(1)


def test_the_example_plan_in_the_docs_loads_with_every_kind():
    plan = load_plan(Path(__file__).parents[2] / "examples" / "chaos_plan.yaml", 4)
    assert {f.kind for f in plan.faults} == set(KINDS)
    assert plan.duration_s == 120.0


def test_a_model_plan_of_process_crashes_restarts_each_at_once():
    plan = model_plan(150, 4, 150, 1, 1, restart=True)
    assert plan.faults and all(f.kind == "crash" and f.restart and f.duration_s == 0 for f in plan.faults)
    assert plan.model["restart"] is True
    assert plan == model_plan(150, 4, 150, 1, 1, restart=True)
