"""Bounds of the chaos analysis on short or cut-short runs: a share of the window is never above 1 (a learner's
steps are booked at most the window's length), and a fault that would have outlived the run ends at the stop."""

from __future__ import annotations

import json

import pytest

from ddiloco.chaos.analysis import analyze_data_parallel, analyze_runtime
from ddiloco.chaos.report import write_report
from tests.runtime_dir import make_runtime_dir, write_json, write_jsonl

FAST_THEN_SLOW = (1.0, 1.3, 1.6, 1.9, 2.0, 2.1)
"""Step end times: gaps 0.3, 0.3, 0.3, 0.1, 0.1, median (nominal) 0.3 s; the first step started at 0.7, the stop
at 2.1: a 1.4 s window holding six steps, 6 x 0.3 = 1.8 s at the nominal step time."""


def test_a_learner_is_never_booked_more_than_the_window(tmp_path):
    # `ddiloco chaos --duration 1` read goodput 1.0398 (report.md: 104.0 %): steps x the median gap, uncapped.
    d = tmp_path / "decoupled"
    write_json(d / "chaos" / "run.json", {"system": "decoupled", "num_learners": 1, "started": 0.0,
                                          "stop_requested": 2.1, "ended": 3.0, "pids": [], "left_behind": []})
    write_jsonl(d / "learners" / "0" / "metrics.jsonl", [
        {"step": n, "time": t, "learner/0/loss": 3.0, "learner/0/step_s": 0.3}
        for n, t in enumerate(FAST_THEN_SLOW, start=1)])
    r = analyze_runtime(d)
    assert r["window_s"] == pytest.approx(1.4)
    assert r["goodput"] <= 1.0
    assert r["goodput"] == pytest.approx(1.0)
    assert r["work_s"]["computed"] == pytest.approx(1.4)


def test_a_data_parallel_rank_is_never_booked_more_than_the_window(tmp_path):
    d = tmp_path / "data_parallel"
    write_json(d / "chaos" / "run.json", {"system": "data_parallel", "num_learners": 1, "started": 0.0,
                                          "stop_requested": 2.1, "ended": 3.0, "pids": [], "left_behind": []})
    write_jsonl(d / "metrics.jsonl", [{"event": "attempt_start", "time": 0.5, "attempt": 1, "from_step": 0}])
    write_jsonl(d / "ranks" / "0" / "metrics.jsonl", [
        {"step": n, "time": t, "dp/0/loss": 3.0, "dp/0/step_s": 0.3, "attempt": 1}
        for n, t in enumerate(FAST_THEN_SLOW, start=1)])
    r = analyze_data_parallel(d)
    assert r["goodput"] <= 1.0
    assert r["goodput"] == pytest.approx(1.0)


def test_a_fault_recorded_past_the_stop_ends_at_the_stop_in_results_and_plot(tmp_path):
    # /tmp/probe_chaos/pastend.yaml, as the old runner recorded it: a 100 s partition planned past the stop, and
    # a fault the run did not reach.
    d = make_runtime_dir(tmp_path)
    records = [json.loads(line) for line in (d / "chaos" / "faults.jsonl").read_text().splitlines()]
    records[2]["ended"] = records[2]["started"] + 100.0
    records.append({"index": 3, "kind": "hang", "target": "learner-1", "at_s": 99.5, "duration_s": 5,
                    "restart": True, "value": None, "started": None, "ended": None, "pids": [],
                    "note": "not reached: the run ended first"})
    write_jsonl(d / "chaos" / "faults.jsonl", records)
    r = analyze_runtime(d)
    partition = r["faults"][2]
    assert partition["end_s"] == pytest.approx(r["window_s"])
    assert partition["duration_s"] == pytest.approx(r["window_s"] - partition["start_s"])
    assert len(r["faults"]) == 3 and r["faults_injected"] == 3
    write_json(tmp_path / "plan.json", None)
    write_report(tmp_path, {"decoupled": r}, {"decoupled": {}})
    report = json.loads((tmp_path / "results.json").read_text())
    assert max(f["end_s"] for f in report["systems"]["decoupled"]["faults"]) <= r["window_s"]
