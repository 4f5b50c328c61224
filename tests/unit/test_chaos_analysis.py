"""Analysis, invariants and report of a chaos run, on system directories written by hand (numbers computed by hand
below and in tests/runtime_dir.py), plus one real short `ddiloco run` for the invariants it already satisfies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.chaos import invariants as inv
from ddiloco.chaos.analysis import analyze_data_parallel, analyze_run, analyze_runtime
from ddiloco.chaos.plan import quick_plan
from ddiloco.chaos.report import PLOTS, write_report
from ddiloco.checkpoint import CHECKSUM_KEY, load_tensors, save_tensors
from ddiloco.round_log import RoundLog
from ddiloco.runtime.child_process import process_group_alive
from tests.helpers import TINY_MODEL_FLAGS
from tests.runtime_dir import make_runtime_dir, participant, write_json, write_jsonl


def make_data_parallel_dir(root: Path) -> Path:
    """Two ranks, step 1 s. Attempt 1: steps 1..10 at 2006..2015; rank 1 crashes; attempt 2 restarts from
    step 5 and does steps 6..20 at 2025..2039. Window [2005, 2040]: T = 35, kept 5 + 15 = 20 of 25 computed,
    goodput 20 / 35; new high-water marks in bins 0, 1, 2, 5, 6 of 7 -> uptime 25 / 35."""
    d = root / "data_parallel"
    write_json(d / "chaos" / "run.json", {"system": "data_parallel", "num_learners": 2, "started": 2000.0,
                                          "ended": 2040.0, "pids": [21, 22, 23], "left_behind": []})
    write_jsonl(d / "chaos" / "faults.jsonl", [
        {"index": 0, "kind": "crash", "target": "rank-1", "at_s": 15.5, "duration_s": 0, "restart": True,
         "value": None, "started": 2015.5, "ended": 2015.5, "pids": [23]},
        {"index": 1, "kind": "straggler", "target": "rank-0", "at_s": 31, "duration_s": 2, "restart": True,
         "value": 3.0, "started": 2031.0, "ended": 2033.0, "pids": []},
    ])
    write_jsonl(d / "metrics.jsonl", [
        {"event": "attempt_start", "time": 2001.0, "attempt": 1, "from_step": 0, "pids": [22, 23]},
        {"event": "checkpoint", "time": 2010.5, "attempt": 1, "step": 5},
        {"event": "failure", "time": 2016.0, "attempt": 1, "rank": 1, "cause": "exit -9"},
        {"event": "attempt_start", "time": 2020.0, "attempt": 2, "from_step": 5, "pids": [24, 25]},
        {"event": "stopped", "time": 2039.5, "attempt": 2, "step": 20},
    ])
    for rank in (0, 1):
        lines = [{"step": s, "time": 2005.0 + s, f"dp/{rank}/loss": 3.0, f"dp/{rank}/step_s": 1.0, "attempt": 1}
                 for s in range(1, 11)]
        lines += [{"step": s, "time": 2019.0 + s, f"dp/{rank}/loss": 3.0, f"dp/{rank}/step_s": 1.0, "attempt": 2}
                  for s in range(6, 21)]
        if rank == 0:
            lines += [{"step": 10, "time": 2015.0, "dp/val_loss": 4.0, "attempt": 1},
                      {"step": 20, "time": 2039.0, "dp/val_loss": 3.0, "attempt": 2}]
        write_jsonl(d / "ranks" / str(rank) / "metrics.jsonl", lines)
    write_json(d / "summary.json", {"attempts": 2, "failures": 1, "final_step": 20, "steps_computed": 25,
                                    "steps_kept": 20, "grad_bytes": 100, "allreduce_bytes": 5000,
                                    "final_val_loss": 3.0, "wall_time_s": 40.0})
    return d


def test_runtime_goodput_uptime_and_recovery_match_the_hand_computation(tmp_path):
    r = analyze_runtime(make_runtime_dir(tmp_path))
    assert r["window_s"] == 90.0 and r["allocated_learner_s"] == 180.0
    assert r["work_s"] == pytest.approx({"computed": 124.0, "rejected": 8.0, "dropped": 8.0, "crashed": 12.0,
                                         "resync": 10.0, "unmerged": 8.0, "useful": 78.0})
    assert r["goodput"] == pytest.approx(78.0 / 180.0)
    assert r["uptime"] == pytest.approx(15.0 / 90.0)
    stall_rejoin = [(f["kind"], f["stall_s"], f["rejoin_s"]) for f in r["faults"]]
    assert stall_rejoin == [("crash", 25.0, 49.0), ("syncer_crash", 20.0, 20.0), ("partition", None, None)]
    assert r["val_loss"] == [[-5.0, 5.0], [89.0, 3.5]] and r["final_val_loss"] == 3.5
    assert r["rounds_per_min"] == pytest.approx(2.0) and r["bytes"] == 1234
    assert r["restarts"] == 2 and r["restart_detail"] == {"learners": 1, "syncer": 1}
    assert r["progress"] == [[17.0, 1], [46.0, 2], [70.0, 3]]


def test_a_late_update_merged_folded_into_the_learners_next_one_is_useful_work(tmp_path):
    # The syncer holds a late update in the next round and, when the same learner's next update arrives, merges
    # the two as one participant, recording the earlier one in `folded`. Its work was merged: it must not be
    # booked as accepted-but-unmerged (real straggler runs read 9-14 % goodput lost that way).
    d = make_runtime_dir(tmp_path)
    rounds = [json.loads(line) for line in (d / "rounds.jsonl").read_text().splitlines()]
    folded = dict(participant(0, 1, 56), folded=[[0, 32]])            # learner 0's accepted f1 update at 32
    rounds.append({"round": 3, "fragment": 1, "version": 2, "participants": [folded]})
    write_jsonl(d / "rounds.jsonl", rounds)
    r = analyze_runtime(d)
    assert r["work_s"]["unmerged"] == 0.0 and r["work_s"]["useful"] == pytest.approx(78.0 + 8.0)


def test_data_parallel_counts_rolled_back_steps_and_only_new_high_water_marks(tmp_path):
    r = analyze_data_parallel(make_data_parallel_dir(tmp_path))
    assert r["window_s"] == 35.0 and r["kept_steps"] == 20 and r["computed_steps"] == 25
    assert r["goodput"] == pytest.approx(20.0 / 35.0)
    assert r["work_s"] == pytest.approx({"computed": 50.0, "rolled_back": 10.0, "useful": 40.0})
    assert r["uptime"] == pytest.approx(25.0 / 35.0)
    assert [(f["stall_s"], f["rejoin_s"]) for f in r["faults"]] == [(14.5, 9.5), (1.0, 0.0)]
    assert r["rounds_per_min"] == pytest.approx(20 / (35 / 60)) and r["progress_unit"] == "kept steps"
    assert r["final_val_loss"] == 3.0 and r["bytes"] == 5000 and r["restarts"] == 1


@pytest.mark.parametrize(("make", "analyze"), [(make_runtime_dir, analyze_runtime),
                                               (make_data_parallel_dir, analyze_data_parallel)])
def test_the_window_ends_at_the_stop_request_not_when_shutting_down_is_over(tmp_path, make, analyze):
    d = make(tmp_path)
    before = analyze(d)
    info = json.loads((d / "chaos" / "run.json").read_text())
    # Stopping took 30 s after the stop request at the old end: tear-down, not allocated training time.
    write_json(d / "chaos" / "run.json", {**info, "stop_requested": info["ended"], "ended": info["ended"] + 30.0})
    after = analyze(d)
    assert after["window_s"] == before["window_s"] and after["goodput"] == before["goodput"]
    # Without the record of the request (older runs), the window ends when everything had stopped.
    write_json(d / "chaos" / "run.json", {**info, "ended": info["ended"] + 30.0})
    assert analyze(d)["window_s"] == before["window_s"] + 30.0


def test_synthetic_runtime_directory_passes_every_invariant(tmp_path):
    results = inv.check_invariants(make_runtime_dir(tmp_path))
    results.pop("global_equals_replay")  # needs real round tensors: the real run below checks it
    assert all(r["ok"] for r in results.values()), results
    detail = results["every_update_merged_or_rejected_with_reason"]["detail"]
    assert "merged 4" in detail and "lost_with_syncer 1" in detail and "lost_with_learner 1" in detail


def edit_jsonl(path: Path, change) -> None:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    write_jsonl(path, change(lines))


def test_a_repeated_round_fails_the_round_invariant(tmp_path):
    d = make_runtime_dir(tmp_path)
    edit_jsonl(d / "rounds.jsonl", lambda lines: [*lines, lines[-1]])
    ok, detail = inv.no_committed_round_lost_or_repeated(d)
    assert not ok and "repeated [2]" in detail


def test_a_commit_event_missing_from_the_log_fails_the_round_invariant(tmp_path):
    d = make_runtime_dir(tmp_path)
    edit_jsonl(d / "syncer" / "metrics.jsonl", lambda lines: [
        *lines, {"event": "commit", "time": 1099.6, "round": 3, "fragment": 1, "version": 2, "learners": [0]}])
    ok, detail = inv.no_committed_round_lost_or_repeated(d)
    assert not ok and "commit event of round 3" in detail


def test_an_update_with_no_fate_in_a_clean_incarnation_fails(tmp_path):
    d = make_runtime_dir(tmp_path)
    edit_jsonl(d / "learners" / "0" / "work.jsonl",
               lambda lines: [e for e in lines if not (e["event"] == "fate" and e["inner_step"] == 16)])
    ok, detail = inv.every_update_merged_or_rejected_with_reason(d)
    assert not ok and "learner 0 (incarnation 0) publish of fragment 1 at inner step 16 has no fate" in detail


@pytest.mark.parametrize(("path", "change", "message"), [
    ("learners/0/work.jsonl", lambda e: {**e, "reason": ""} if e.get("fate") == "rejected" else e,
     "rejected fate of fragment 1 at inner step 16 without a reason"),
    ("syncer/metrics.jsonl", lambda e: None if e.get("event") == "update" and e["inner_step"] == 40 else e,
     "accepted by its fate but by no syncer update event"),
    ("syncer/metrics.jsonl", lambda e: {**e, "event": "stopped"} if e.get("source") == "checkpoint" else e,
     "inner step 32 accepted but neither merged"),
])
def test_unexplained_updates_fail_the_update_invariant(tmp_path, path, change, message):
    d = make_runtime_dir(tmp_path)
    edit_jsonl(d / path, lambda lines: [c for e in lines if (c := change(e)) is not None])
    ok, detail = inv.every_update_merged_or_rejected_with_reason(d)
    assert not ok and message in detail


def test_a_discarded_update_is_explained(tmp_path):
    d = make_runtime_dir(tmp_path)
    edit_jsonl(d / "syncer" / "metrics.jsonl", lambda lines: [
        {**e, "event": "stopped"} if e.get("source") == "checkpoint" else e for e in lines] + [
        {"event": "discarded", "time": 1099.0, "learner_id": 0, "fragment": 1, "base_version": 0, "inner_step": 32,
         "reason": "stopped"}])
    ok, detail = inv.every_update_merged_or_rejected_with_reason(d)
    assert ok and "discarded 1" in detail, detail


def test_refused_calls_summed_up_by_the_syncer_count_as_rejections(tmp_path):
    d = make_runtime_dir(tmp_path)  # one rejected update
    edit_jsonl(d / "syncer" / "metrics.jsonl", lambda lines: [*lines, *[
        {"event": "rejection", "time": 1099.0, "learner_id": None, "reason": "unauthenticated",
         "detail": "wrong run token", "peer": "ipv4:10.0.0.9:4000", "fragment": None, "inner_step": None},
        {"event": "rejections_suppressed", "time": 1099.5, "reason": "unauthenticated", "peer": "ipv4:10.0.0.9",
         "count": 999}]])
    ok, detail = inv.every_update_merged_or_rejected_with_reason(d)
    assert ok and "syncer_rejections 1001" in detail, detail


@pytest.mark.parametrize(("path", "change", "message"), [
    ("rounds.jsonl", lambda e: {**e, "participants": [participant(0, 5, 40)]} if e["round"] == 1 else e,
     "round 1 merged learner 0's update on base 5 of fragment 0, which was at version 1"),
    ("syncer/metrics.jsonl", lambda e: {**e, "source": "init"} if e.get("source") == "checkpoint" else e,
     "syncer start 1 from 'init', expected 'checkpoint'"),
    ("syncer/metrics.jsonl", lambda e: {**e, "rounds_committed": 1} if e.get("source") == "checkpoint" else e,
     "syncer start 1 holds 1 rounds but 2 were committed"),
    ("learners/1/work.jsonl", lambda e: None if e["event"] == "welcome" and e["time"] > 1040 else e,
     "learner 1 (incarnation 1) published fragment 1 at inner step 18 before any Welcome"),
    ("learners/0/work.jsonl", lambda e: {**e, "versions": [2, 3]} if e["event"] == "welcome" else e,
     "learner 0 (incarnation 0) published fragment 0 on base 0, older than its Welcome's 2"),
])
def test_a_fresh_or_too_new_source_fails_the_source_invariant(tmp_path, path, change, message):
    d = make_runtime_dir(tmp_path)
    edit_jsonl(d / path, lambda lines: [c for e in lines if (c := change(e)) is not None])
    ok, detail = inv.no_fresh_learner_became_global_source(d)
    assert not ok and message in detail, detail


def test_a_process_left_behind_fails_for_every_system(tmp_path):
    for d in (make_runtime_dir(tmp_path), make_data_parallel_dir(tmp_path)):
        info = json.loads((d / "chaos" / "run.json").read_text())
        write_json(d / "chaos" / "run.json", {**info, "left_behind": [12]})
        ok, detail = inv.no_process_left_behind(d)
        assert not ok and "1 of" in detail and "[12]" in detail
    assert list(inv.check_invariants(tmp_path / "data_parallel")) == ["no_process_left_behind"]


def test_report_writes_markdown_results_and_plots(tmp_path):
    make_runtime_dir(tmp_path)
    make_data_parallel_dir(tmp_path)
    quick_plan(2).save(tmp_path / "plan.json")
    write_json(tmp_path / "settings.json", {"warm_restarts": True, "dp_checkpoint_every_s": 20.0, "threads": 1})
    results = analyze_run(tmp_path)
    assert list(results) == ["decoupled", "data_parallel"]
    path = write_report(tmp_path, results)
    text = path.read_text()
    for needle in ("| decoupled | 43.3% | 16.7% |", "| data_parallel | 57.1% | 71.4% |", "kept steps",
                   "| decoupled | 1 | syncer_crash | syncer |", "no_process_left_behind", "## Plan",
                   "## Definitions", "Restarts: warm (standby processes); data-parallel checkpoint every 20.0 s"):
        assert needle in text, needle
    document = json.loads((tmp_path / "results.json").read_text())
    assert set(document) == {"systems", "invariants", "invariant_details", "plan", "settings"}
    assert document["settings"]["warm_restarts"] is True
    assert document["invariants"]["no_process_left_behind"] is True
    assert document["invariants"]["global_equals_replay"] is False  # the synthetic rounds have no tensors
    assert document["plan"]["source"] == "quick"
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


# ---- one real run --------------------------------------------------------------------------------------

REPO = Path(__file__).parents[2]
RUN_WAIT_S = 240.0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(300)
def test_real_run_satisfies_rounds_replay_and_processes_and_a_tampered_round_fails_replay(tmp_path):
    run_dir = tmp_path / "decoupled"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress",
                              *TINY_MODEL_FLAGS, "--learners", "2", "--inner-steps", "60", "--num-fragments", "2",
                              "--sync-every", "8", "--threads", "1", "--round-files", "all"],  # a genesis replay
                             cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = popen.communicate(timeout=RUN_WAIT_S)[0]
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, out
    processes = json.loads((run_dir / "launcher" / "processes.json").read_text())
    pids = [pid for group in processes["children"].values() for pid in group]
    # What the chaos runner records after its stop.
    write_json(run_dir / "chaos" / "run.json", {"system": "decoupled", "num_learners": 2, "started": 0.0,
                                                "ended": 0.0, "pids": pids,
                                                "left_behind": [p for p in pids if process_group_alive(p)]})
    for check in ("no_committed_round_lost_or_repeated", "global_equals_replay", "no_process_left_behind"):
        ok, detail = inv.CHECKS[check](run_dir)
        assert ok, f"{check}: {detail}"
    rounds = len((run_dir / "rounds.jsonl").read_text().splitlines())
    assert rounds > 0 and inv.no_committed_round_lost_or_repeated(run_dir)[1].startswith(f"{rounds} rounds,")

    tampered = tmp_path / "tampered"
    shutil.copytree(run_dir, tampered)
    first = tampered / "rounds" / "round_000000.safetensors"
    tensors = load_tensors(first)
    name = sorted(tensors)[0]
    checksum = save_tensors(first, {**tensors, name: tensors[name] + 1e-3})
    ok, detail = inv.global_equals_replay(tampered)
    assert not ok and "round 0 is damaged" in detail  # its checksum no longer matches its line
    # A round rewritten together with its line's checksum replays, into another global state.
    log = RoundLog(tampered)
    lines = log.lines()
    lines[0][CHECKSUM_KEY] = checksum
    log.path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ok, detail = inv.global_equals_replay(tampered)
    assert not ok and "differ from the replay" in detail


def _unlogged_merge(learner: int, inner: int):
    """The syncer was killed between the fsync of a round and the "update" line of the update that closed it: the
    line is missing, and the learner, whose reply never came, saw its update dropped."""
    def syncer_lines(lines):
        return [e for e in lines if not (e.get("event") == "update" and e["learner_id"] == learner
                                         and e["inner_step"] == inner)]

    def learner_lines(lines):
        return [{**e, "fate": "dropped", "reason": "syncer unreachable"}
                if e.get("event") == "fate" and e["inner_step"] == inner else e for e in lines]
    return syncer_lines, learner_lines


@pytest.mark.parametrize(("learner", "inner", "ok"), [
    (0, 40, True),    # round 1: the last round of the killed incarnation 0
    (1, 8, False),    # round 0: incarnation 0 went on committing after it, so the line cannot be missing
    (1, 18, False),   # round 2: incarnation 1 stopped cleanly
])
def test_only_the_last_round_of_a_killed_syncer_may_lack_its_closing_update_line(tmp_path, learner, inner, ok):
    d = make_runtime_dir(tmp_path)
    syncer_lines, learner_lines = _unlogged_merge(learner, inner)
    edit_jsonl(d / "syncer" / "metrics.jsonl", syncer_lines)
    edit_jsonl(d / "learners" / str(learner) / "work.jsonl", learner_lines)
    passed, detail = inv.every_update_merged_or_rejected_with_reason(d)
    assert passed is ok, detail
    if ok:
        assert "merged_as_the_syncer_was_killed 1" in detail and "merged 4" in detail
    else:
        assert f"inner step {inner}: accepted 0 time(s)" in detail
