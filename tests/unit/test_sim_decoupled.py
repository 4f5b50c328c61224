"""The Decoupled DiLoCo driver of the virtual-time harness: real learners and syncer on one virtual clock."""

import math

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.sim.accounting import HARNESS_CATEGORIES, PeakMeter, union_length
from ddiloco.sim.cluster import ClusterConfig, StepTimer
from ddiloco.sim.faults import FaultPlan
from ddiloco.sim.links import LinkConfig
from ddiloco.syncer import replay_rounds
from tests.helpers import DECOUPLED_DILOCO, run_decoupled

torch.set_num_threads(1)

def kinds(result, kind):
    return [entry for entry in result.log if entry["kind"] == kind]


def test_a_run_without_failures_spends_the_budget_and_merges_every_round():
    sim, result = run_decoupled()
    m = result.metrics
    budget = sim.config.workload.token_budget(3)
    assert m["tokens_processed"] == budget
    assert [p["inner_steps"] for p in m["participation"].values()] == [16, 16, 16]
    # Until the syncer has a step-time estimate the adaptive grace window is 0, so the first rounds
    # close with the first update and the others' updates open extra rounds; after that, with equal
    # speeds, the grace window lets everyone in.
    commits = kinds(result, "commit")
    assert len(commits) >= 16 // 8 * 4
    assert all(c["learners"] == [0, 1, 2] for c in commits[-4:])
    assert m["uptime"] == pytest.approx(1.0) and m["uptime_while_alive"] == pytest.approx(1.0)
    assert m["rejections"] == {} and m["blocked_fraction"] == 0
    assert m["work_breakdown"]["crashed"] == 0 and m["work_breakdown"]["rejected"] == 0
    # Fragment p was last published (H - due offset) steps before the end; the final flush
    # (LearnerRules.finish) publishes those steps too, so no work is left unfinished.
    assert m["work_breakdown"]["unfinished"] == 0
    last = {(e["learner"], e["message"]["fragment"]) for e in kinds(result, "send_up")
            if e["message"]["type"] == "Update" and e["message"]["inner_step"] == 16}
    assert last == {(m, p) for m in range(3) for p in range(sim.syncer.plan.num_fragments)}
    assert sim.syncer.alive_learners() == []  # every learner left after spending the budget
    assert result.curve[0].tokens == 0 and result.curve[-1].tokens == budget


def test_work_categories_add_up_to_the_compute_time():
    faults = FaultPlan.of([(1, 5.5, 9.0)])
    sim, result = run_decoupled(faults=faults, cluster=ClusterConfig(num_learners=3, jitter=0.2))
    computed = sum(entry["duration_s"] for entry in kinds(result, "step"))
    booked = sum(sim.work.seconds.total(c) for c in HARNESS_CATEGORIES)
    # The step cut short by the crash was never completed and holds no work.
    assert booked == pytest.approx(computed, rel=1e-12)
    assert sim.work.seconds.total("crashed") > 0


def test_round_log_replays_to_the_final_global_parameters():
    sim, result = run_decoupled(faults=FaultPlan.of([(0, 3.0, 7.0)]))
    replayed = replay_rounds(sim.config.diloco, sim.initial_params, result.round_log)
    assert all(torch.equal(replayed[n], t) for n, t in result.final_params.items())


def test_a_failed_learner_loses_its_messages_and_rejoins_as_a_new_incarnation():
    slow = LinkConfig(latency_s=3.0, bandwidth_bps=1e9)  # updates stay in flight for 3 s
    cluster = ClusterConfig(num_learners=3, uplink=slow, downlink=slow)
    # Joining takes 6 s (Join up, Welcome down); learner 2 publishes fragment 1 at inner step 4
    # (t = 10) and fails 0.5 s later, while that update is still in flight.
    sim, result = run_decoupled(cluster=cluster, faults=FaultPlan.of([(2, 10.5, 16.0)]), steps=24)
    dropped = [e for e in kinds(result, "drop_up") if e["learner"] == 2]
    assert any(e["message"]["type"] == "Update" for e in dropped)
    assert result.metrics["participation"]["2"]["incarnations"] == 2
    assert sim.syncer.learners[2].joins == 2
    position = kinds(result, "schedule_position")
    assert len(position) == 1 and position[0]["learner"] == 2
    fail_at = kinds(result, "fail")[0]["t"]
    steps_of_2 = [e["t"] for e in kinds(result, "step") if e["learner"] == 2]
    assert not [t for t in steps_of_2 if fail_at < t <= 16.0]  # nothing computed while down


def test_k1_keeps_training_whenever_a_learner_is_alive():
    # Learners 0 and 1 fail in turn; learner 2 is never down: a round commits in every sync period.
    faults = FaultPlan.of([(0, 3.5, 9.0), (1, 6.0, 14.0)])
    _, result = run_decoupled(faults=faults, steps=24)
    assert result.metrics["uptime"] == pytest.approx(1.0)
    assert result.metrics["uptime_while_alive"] == pytest.approx(1.0)
    assert result.metrics["goodput"] < 1.0


def test_uptime_is_the_share_of_sync_periods_in_which_a_round_commits():
    # K = M: learner 1 is down from 4.5 s to 30 s and the others wait for it; rounds commit at 2 and 4 s,
    # then none until it is back (31 s, the first round after its Welcome). Of the 8 s bins (H = 8 steps of
    # 1 s) from the first step's start, the second and third hold no commit.
    _, result = run_decoupled(quorum=QuorumConfig(min_quorum=3, grace="none"),
                              faults=FaultPlan.of([(1, 4.5, 30.0)]), steps=24)
    events = result.events
    commits = [e["t"] for e in kinds(result, "commit")]
    assert [a.time_s for a in events.advances] == commits
    assert not [t for t in commits if events.start_s + 8 <= t < events.start_s + 24]
    assert result.metrics["uptime"] == pytest.approx(1 - 16 / events.window_s)
    assert [(f.target, f.start_s, f.end_s) for f in events.faults] == [(1, 4.5, 30.0)]


def test_quorum_of_all_learners_waits_for_the_slow_one_and_k1_does_not():
    cluster = ClusterConfig(num_learners=3, slowdowns=(0.0, 0.0, 1.0))
    _, sync = run_decoupled(cluster=cluster, quorum=QuorumConfig(min_quorum=3, grace="none"))
    _, k1 = run_decoupled(cluster=cluster, quorum=QuorumConfig(min_quorum=1, grace="none"))
    assert sync.metrics["blocked_fraction"] > 0.2
    assert k1.metrics["blocked_fraction"] == 0
    assert sync.metrics["goodput"] < k1.metrics["goodput"]
    first_leave = kinds(sync, "leave")[0]["t"]
    assert all(c["learners"] == [0, 1, 2] for c in kinds(sync, "commit") if c["t"] < first_leave)


def test_a_blocked_learner_stops_waiting_after_max_wait():
    cluster = ClusterConfig(num_learners=2, slowdowns=(0.0, 9.0))  # learner 1 takes 10 s per inner step
    _, result = run_decoupled(cluster=cluster, quorum=QuorumConfig(min_quorum=2, grace="none"),
                              learner=LearnerConfig(max_wait_s=3.0))
    assert result.metrics["waits_abandoned"] > 0
    waits = [e for e in kinds(result, "stop_waiting") if e["learner"] == 0]
    blocked = [e for e in kinds(result, "blocked") if e["learner"] == 0]
    assert waits and all(math.isclose(w["t"] - b["t"], 3.0) for w, b in zip(waits, blocked, strict=False))


def test_synchronous_diloco_survives_a_failure_without_deadlock():
    faults = FaultPlan.of([(1, 4.5, 10.0)])
    _, result = run_decoupled(num=3, quorum=QuorumConfig(min_quorum=3, grace="none"), faults=faults, steps=32)
    m = result.metrics
    assert m["waits_abandoned"] == 0
    assert m["participation"]["1"]["incarnations"] == 2
    # The returning learner takes part in every round again until the budget is spent.
    first_leave = kinds(result, "leave")[0]["t"]
    late = [e for e in kinds(result, "commit") if 10.0 < e["t"] < first_leave]
    assert late and all(e["learners"] == [0, 1, 2] for e in late)


def test_heartbeats_keep_a_learner_known_and_silence_times_it_out():
    # Learner 1 is down for longer than the heartbeat timeout: the syncer forgets it, then it rejoins.
    quorum = QuorumConfig(heartbeat_timeout_s=4.0)
    sim, result = run_decoupled(quorum=quorum, faults=FaultPlan.of([(1, 2.5, 12.0)]), steps=24,
                                learner=LearnerConfig(heartbeat_every_s=1.0))
    sends = [e for e in kinds(result, "send_up") if e["message"]["type"] == "Heartbeat"]
    assert sends
    assert sim.syncer.learners[1].joins == 2


def test_step_times_follow_speed_and_jitter():
    cluster = ClusterConfig(num_learners=2, step_time_s=2.0, slowdowns=(0.0, 0.5), jitter=0.1)
    fast, slow = StepTimer(cluster, learner_id=0, seed=1), StepTimer(cluster, learner_id=1, seed=1)
    fast_draws = [fast.next_duration_s() for _ in range(500)]
    slow_draws = [slow.next_duration_s() for _ in range(500)]
    assert min(fast_draws) >= 1.8 and max(fast_draws) <= 2.2
    assert min(slow_draws) >= 2.7 and max(slow_draws) <= 3.3
    assert sum(slow_draws) / sum(fast_draws) == pytest.approx(1.5, rel=0.02)


def test_steady_state_peak_upload_is_one_fragment_per_step():
    sim, result = run_decoupled()
    codec = get_codec(DECOUPLED_DILOCO.codec)
    shapes = {n: t.numel() for n, t in sim.initial_params.items()}
    fragment_bytes = [sum(codec.encoded_nbytes(shapes[n]) for n in names) for names in sim.syncer.plan.fragments]
    assert result.metrics["peak_bytes_per_step_up"] == max(fragment_bytes)
    assert result.metrics["max_bytes_per_step_down"] >= result.metrics["peak_bytes_per_step_down"] > 0


def test_peak_meter_counts_windows_per_learner():
    meter = PeakMeter(1.0)
    for learner, time_s, nbytes in [(0, 0.5, 100), (0, 0.7, 100), (1, 0.6, 50), (1, 3.2, 150), (0, 9.5, 500)]:
        meter.add(learner, time_s, nbytes)
    assert meter.peak() == 500
    assert meter.peak(0.0, 2.0) == 200  # learner 0's two messages share window 0
    assert meter.peak(1.0, 9.0) == 150


def test_union_length_merges_overlapping_intervals():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(0, 10)], end_s=4) == 4
    assert union_length([]) == 0


@pytest.mark.parametrize("field, value", [("num_learners", 0), ("step_time_s", 0.0), ("jitter", 1.0),
                                          ("slowdowns", (0.1,))])
def test_cluster_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{field: value})


def test_a_learner_back_from_a_failure_out_of_phase_with_the_rounds_is_brought_into_them():
    # Learner 2 comes back between two rounds' due steps: its schedule position (one step before the next round)
    # puts it ahead of the others, and with K = 1 it closes that round alone. Without the others moving their
    # schedules forward on a result that does not name them (`Learner._follow_close`), their updates reached
    # every later round after its close and were merged one version late (17 of the 20 rounds below).
    sim, result = run_decoupled(faults=FaultPlan.of([(2, 10.5, 14.5)]), steps=64)
    later = [c for c in kinds(result, "commit") if c["t"] > 14.5 + 20]
    assert len(later) >= 16
    assert all(c["learners"] == [0, 1, 2] and c["staleness"] == [0, 0, 0] for c in later)
    assert sum(slot.learner.stats.phase_moves_late for slot in sim.slots) >= 1


def test_without_overlap_learners_in_step_share_every_round():
    # tau = 0, K = 1, a round every step: the adaptive window's floor (a quarter step) gathers learners that publish
    # together. Without it every round closed on its first update and the others rode one version late (and the
    # schedule moves that followed made a fragment due twice after one step, which the work ledger failed on).
    diloco = DilocoConfig(num_fragments=1, fragment_strategy="single", sync_every=1, overlap_steps=0)
    _, result = run_decoupled(diloco=diloco, steps=12)
    m = result.metrics
    # One round a step; the first closes on its first update (no step time yet), every later one merges all three.
    assert (m["rounds_committed"], m["mean_staleness"]) == (12, 0)
    assert m["mean_participants_per_round"] == pytest.approx((1 + 11 * 3) / 12)
