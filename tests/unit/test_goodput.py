"""The one definition of goodput, uptime, merged work and recovery time (`ddiloco.goodput`): hand-computed
logs, the JSONL form, and the same log through the harness's accounting and the chaos analysis."""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.chaos.analysis import analyze_runtime, log_results, runtime_event_log
from ddiloco.goodput import (
    Advance,
    EventLog,
    FaultSpan,
    Work,
    binned_uptime,
    goodput,
    merged_work_fraction,
    rejoin_s,
    stall_s,
    summarize,
    uptime,
    work_breakdown,
)
from ddiloco.sim.accounting import core_metrics
from ddiloco.sim.faults import FaultPlan
from tests.helpers import run_decoupled
from tests.runtime_dir import make_runtime_dir

torch.set_num_threads(1)


def hand_log() -> EventLog:
    """Two learners, window [10, 30): T = 20, allocated 40 learner-seconds.

    learner 0: merged 12, overwritten 2, crashed 3; learner 1: merged 6, unfinished 1, rejected 4, kept 5.
    useful = 12 + 2 + 6 + 1 + 5 = 26 -> goodput 26 / 40; merged 18 / 40.
    Advances at 11, 14, 22, 29.5 and 31 (after the window) in 4 s bins from 10: [10, 14) holds 11, [14, 18)
    holds 14, [22, 26) holds 22, the last, partial bin [26, 30) holds 29.5 -> 16 of 20 s up.
    Faults: learner 1 down [15, 20) (stall to 22, merged again first at 29.5), the syncer at 14 (an advance at
    its very instant is pre-fault: stall to 22, rejoin 8), learner 0 at 28 with its return observed at 33,
    after the window (rejoin None).
    """
    work = (Work(0, "merged", 12.0), Work(0, "overwritten", 2.0), Work(0, "crashed", 3.0),
            Work(1, "merged", 6.0), Work(1, "unfinished", 1.0), Work(1, "rejected", 4.0), Work(1, "kept", 5.0))
    advances = (Advance(22.0, (0,)), Advance(11.0, (0, 1)), Advance(14.0, (0,)), Advance(29.5, (0, 1)),
                Advance(31.0, (0, 1)))
    faults = (FaultSpan(1, 15.0, 20.0), FaultSpan(None, 14.0, 14.0, "syncer_crash"),
              FaultSpan(0, 28.0, 29.0, back_s=33.0))
    return EventLog(num_learners=2, start_s=10.0, end_s=30.0, uptime_bin_s=4.0, work=work, advances=advances,
                    faults=faults)


def test_goodput_merged_work_and_breakdown_match_the_hand_computation():
    log = hand_log()
    assert log.allocated_s == 40.0
    assert goodput(log) == pytest.approx(26 / 40)
    assert merged_work_fraction(log) == pytest.approx(18 / 40)
    breakdown = work_breakdown(log)
    assert breakdown["crashed"] == pytest.approx(3 / 40) and breakdown["kept"] == pytest.approx(5 / 40)
    assert sum(breakdown.values()) == pytest.approx(33 / 40)  # every booked second, useful or lost


def test_uptime_counts_bins_with_an_advance_and_the_last_partial_bin_by_its_length():
    log = hand_log()
    assert uptime(log) == pytest.approx(16 / 20)
    # The last bin [26, 30) is partial when the window ends at 28: 2 s long, holding no advance then.
    shorter = EventLog(num_learners=2, start_s=10.0, end_s=28.0, uptime_bin_s=4.0, advances=log.advances)
    assert uptime(shorter) == pytest.approx(12 / 18)
    assert binned_uptime([10.0, 13.9], 10.0, 20.0, 5.0) == pytest.approx(0.5)
    assert binned_uptime([], 10.0, 20.0, 5.0) == 0.0 and binned_uptime([10.0], 10.0, 10.0, 5.0) == 0.0


def test_stall_and_rejoin_match_the_hand_computation():
    log = hand_log()
    learner, syncer, observed = log.faults
    assert (stall_s(log, learner), rejoin_s(log, learner)) == (7.0, 9.5)
    assert (stall_s(log, syncer), rejoin_s(log, syncer)) == (8.0, 0.0)
    assert (stall_s(log, observed), rejoin_s(log, observed)) == (1.5, None)
    never = FaultSpan(0, 20.0, 21.0, back_s=math.inf)
    assert rejoin_s(log, never) is None
    assert summarize(log).recoveries == ((7.0, 9.5), (8.0, 0.0), (1.5, None))


def test_the_jsonl_form_reads_back_to_the_same_log(tmp_path):
    log = hand_log()
    again = EventLog.read(log.write(tmp_path / "events.jsonl"))
    assert again == log
    assert summarize(again) == summarize(log)


@pytest.mark.parametrize(("change", "message"), [
    (dict(uptime_bin_s=0.0), "uptime_bin_s=0.0 is invalid"),
    (dict(end_s=5.0), "end_s=5.0 is invalid"),
    (dict(num_learners=0), "num_learners=0 is invalid"),
    (dict(categories=("merged", "lucky")), "categories='lucky' is invalid"),
])
def test_a_malformed_log_is_refused(change, message):
    fields = dict(num_learners=2, start_s=10.0, end_s=30.0, uptime_bin_s=4.0) | change
    with pytest.raises(ValueError, match=message):
        EventLog(**fields)
    with pytest.raises(ValueError, match="category='lucky' is invalid"):
        Work(0, "lucky", 1.0)


def both_analyses(log: EventLog) -> tuple[dict, dict]:
    harness = core_metrics(log, final_loss=0.0, tokens_processed=0, tokens_merged=0.0)
    chaos = log_results(log)
    return harness, chaos


def test_one_log_gives_the_same_goodput_and_uptime_in_the_harness_and_the_chaos_analysis():
    harness, chaos = both_analyses(hand_log())
    assert harness["goodput"] == chaos["goodput"] == pytest.approx(26 / 40)
    assert harness["uptime"] == chaos["uptime"] == pytest.approx(16 / 20)
    assert harness["virtual_time_s"] == chaos["window_s"] == 20.0


def test_a_real_run_directory_converted_to_the_log_measures_the_same_in_the_harness(tmp_path):
    d = make_runtime_dir(tmp_path)
    log = runtime_event_log(d)
    harness, _ = both_analyses(log)
    chaos = analyze_runtime(d)
    assert harness["goodput"] == chaos["goodput"] == pytest.approx(78 / 180)
    assert harness["uptime"] == chaos["uptime"] == pytest.approx(15 / 90)


def test_a_simulated_run_written_as_a_log_measures_the_same_in_the_chaos_analysis(tmp_path):
    _, result = run_decoupled(faults=FaultPlan.of([(0, 3.5, 9.0), (1, 6.0, 14.0)]), steps=24)
    log = EventLog.read(result.events.write(tmp_path / "events.jsonl"))
    chaos = log_results(log)
    assert chaos["goodput"] == result.metrics["goodput"] < 1.0
    assert chaos["uptime"] == result.metrics["uptime"]
    assert [f["target"] for f in chaos["faults"]] == [0, 1]
    # Learner 2 never fails and K = 1: a round commits within a second of each outage's start.
    assert all(0 < f["stall_s"] < 2.5 for f in chaos["faults"])
