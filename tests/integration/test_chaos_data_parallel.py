"""The synchronous data-parallel baseline as real processes: DDP over gloo on 127.0.0.1, two ranks, and the
agent that restarts the whole job from its checkpoint after a kill -9, a SIGSTOP, or a dropped message, and
waits for a held rank.

Every wait has a hard deadline; each test stops its job (SIGTERM, then SIGKILL) and checks that no rank's
process group is left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import pytest
import torch

from ddiloco.chaos.data_parallel import DataParallelAgentConfig, DataParallelJob
from ddiloco.chaos.dp_common import params_digest
from ddiloco.checkpoint import load_latest_state, read_json
from ddiloco.fault_control import ActiveFault, write_control
from ddiloco.model import build_model
from ddiloco.run_config import add_run_config_flags, run_config_from_args
from ddiloco.runtime.child_process import process_group_alive
from tests.helpers import TINY_MODEL_FLAGS, wait_until

pytestmark = pytest.mark.integration

FAST = dict(threads=1, eval_every_s=2.0, checkpoint_every_s=2.0, hang_timeout_s=10.0, stop_timeout_s=10.0)
"""Checkpoints and evaluations come every 2 s so a test sees several in a few seconds."""


def tiny_run_config():
    parser = argparse.ArgumentParser()
    add_run_config_flags(parser)
    return run_config_from_args(parser.parse_args([*TINY_MODEL_FLAGS, "--learners", "2"]))


@pytest.fixture
def make_job(tmp_path):
    """Builds jobs in tmp_path; stops each at the end and fails the test if any rank it ever started is left."""
    jobs = []

    def make(**overrides):
        job = DataParallelJob(DataParallelAgentConfig(**{**FAST, **overrides}), run_config=tiny_run_config(),
                              job_dir=tmp_path / f"job{len(jobs)}")
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        if job.started and not job.finished:
            job.stop()
        started = [pid for e in events(job, "attempt_start") for pid in e["pids"].values()] + job.standby_pids
        left = [pid for pid in started if process_group_alive(pid)]
        assert not left, f"rank processes left behind: {left}"


def events(job, kind=None):
    if not job.paths.metrics.exists():
        return []
    lines = [json.loads(line) for line in job.paths.metrics.read_text().splitlines()]
    return [e for e in lines if kind is None or e["event"] == kind]


def steps(job, rank):
    """(attempt, step, loss) of every training step a rank logged, in order."""
    lines = [json.loads(line) for line in job.paths.rank_metrics(rank).read_text().splitlines()]
    return [(r["attempt"], r["step"], r[f"dp/{rank}/loss"]) for r in lines if f"dp/{rank}/loss" in r]


def drive(job, condition, what, timeout_s=60.0):
    """Poll the agent (as the chaos runner's loop does) until `condition()` holds."""
    return wait_until(lambda: (job.poll(), condition())[1], what, timeout_s=timeout_s)


def checkpoint_after(job, step):
    return next((e["step"] for e in events(job, "checkpoint") if e["step"] > step), None)


# With make acceptance: the default suite took 940 s on 2 cores (2026-12-05); the other tests here run the baseline.
@pytest.mark.acceptance
def test_clean_run_trains_with_identical_replicas(make_job):
    job = make_job()
    summary = job.run(duration_s=8.0)

    assert summary["attempts"] == 1 and summary["failures"] == 0
    rank0, rank1 = steps(job, 0), steps(job, 1)
    final = summary["final_step"]
    assert final > 50
    assert [s for _, s, _ in rank0] == [s for _, s, _ in rank1] == list(range(1, final + 1))
    assert summary["steps_computed"] == summary["steps_kept"] == final
    assert summary["allreduce_bytes"] == final * 2 * (2 * (2 - 1) / 2) * summary["grad_bytes"]
    losses = [loss for _, _, loss in rank0]
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.5, "the loss did not fall"
    val = [json.loads(line) for line in job.paths.rank_metrics(0).read_text().splitlines()]
    val = [(r["step"], r["dp/val_loss"]) for r in val if "dp/val_loss" in r]
    assert val[0][0] == 0 and val[-1][0] == final and len(val) >= 4
    assert val[-1][1] < val[0][1] - 0.5 and summary["final_val_loss"] == val[-1][1]

    # Both replicas end bitwise-equal, and equal to the final checkpoint.
    status = [read_json(job.paths.rank_status(rank)) for rank in (0, 1)]
    assert status[0]["phase"] == status[1]["phase"] == "stopped"
    assert status[0]["params_step"] == status[1]["params_step"] == final
    assert status[0]["params_sha256"] == status[1]["params_sha256"]
    state, _, serial = load_latest_state(job.paths.checkpoints)
    torch.manual_seed(0)
    model = build_model(job.run_config.model)
    model.load_state_dict(state["model"])
    assert serial == final and params_digest(model) == status[0]["params_sha256"]
    assert [e["step"] for e in events(job, "stopped")] == [final]


def test_kill_9_of_one_rank_restarts_every_rank_from_the_checkpoint(make_job):
    job = make_job(standby_ranks=2)  # the restart runs in warm standby ranks (the SIGSTOP test's restart is cold)
    job.start()
    first = drive(job, lambda: checkpoint_after(job, 0), "a first checkpoint")
    drive(job, lambda: job.step > first + 20, "steps after the checkpoint")
    old_pids = job.pids()
    os.killpg(old_pids[1], signal.SIGKILL)
    drive(job, lambda: events(job, "training")[1:], "the second attempt to train")
    restarted_from = events(job, "attempt_start")[1]["from_step"]
    drive(job, lambda: job.step > restarted_from + 20, "the second attempt to pass the rolled-back steps")
    summary = job.stop()

    assert [(e["attempt"], e["rank"], e["cause"]) for e in events(job, "failure")] == [(1, 1, "signal SIGKILL")]
    new_pids = {int(rank): pid for rank, pid in events(job, "attempt_start")[1]["pids"].items()}
    assert all(new_pids[rank] != old_pids[rank] for rank in (0, 1))
    assert set(new_pids.values()) <= set(job.standby_pids) and not set(old_pids.values()) & set(job.standby_pids)
    assert restarted_from >= first
    for rank in (0, 1):
        logged = steps(job, rank)
        first_try = {s: loss for attempt, s, loss in logged if attempt == 1}
        second_try = [(s, loss) for attempt, s, loss in logged if attempt == 2]
        assert second_try[0][0] == restarted_from + 1, "the second attempt must continue from the checkpoint"
        rolled_back = [s for s in first_try if s > restarted_from]
        assert rolled_back, "steps after the checkpoint were computed by the first attempt"
        # The same model, optimizer and data cursor: the rolled-back steps are computed again, identically.
        assert all(first_try[s] == loss for s, loss in second_try if s in first_try)
    assert summary["attempts"] == 2
    assert summary["steps_rolled_back"] == max(s for a, s, _ in steps(job, 0) if a == 1) - restarted_from


def test_sigstopped_rank_is_detected_by_the_no_progress_timeout(make_job):
    job = make_job(hang_timeout_s=3.0)
    job.start()
    drive(job, lambda: events(job, "training"), "training")
    stopped_pid = job.pids()[1]
    os.killpg(stopped_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    failures = drive(job, lambda: events(job, "failure"), "the hang to be detected")
    detected_after = time.monotonic() - stopped_at
    drive(job, lambda: events(job, "training")[1:], "the restarted job to train")
    job.stop()

    assert 3.0 <= detected_after < 3.0 + 2.0
    # Rank 0, waiting for rank 1 in a collective, keeps its liveness file fresh: only the stopped rank is blamed.
    assert [(e["rank"], e["cause"].split(" (")[0]) for e in failures] == [(1, "no progress for 3 s")]
    assert failures[0]["cause"].endswith("process unresponsive)")
    assert not process_group_alive(stopped_pid)


def test_no_restart_before_a_held_rank_is_back(make_job):
    job = make_job()
    job.start()
    drive(job, lambda: events(job, "training"), "training")
    until = time.time() + 4.0
    job.hold(1, until)
    os.killpg(job.pids()[1], signal.SIGKILL)
    drive(job, lambda: not job.running, "the failure to be handled")
    assert job.pids() == {}
    drive(job, lambda: job.running, "the restart")
    job.stop()

    assert events(job, "held")[0]["rank"] == 1 and events(job, "held")[0]["until"] == until
    second = events(job, "attempt_start")[1]
    assert second["time"] >= until
    assert second["time"] - events(job, "failure")[0]["time"] >= 3.0


def test_dropped_message_fails_the_step_and_the_job_restarts(make_job):
    job = make_job()
    job.start()
    drive(job, lambda: events(job, "training"), "training")
    write_control(job.control_file(1), [ActiveFault("drop", time.time() + 60.0, 1.0)])
    failure = drive(job, lambda: events(job, "failure"), "the dropped message to fail rank 1")[0]
    write_control(job.control_file(1), [])
    drive(job, lambda: events(job, "training")[1:], "the restarted job to train")
    job.stop()

    assert (failure["rank"], failure["cause"]) == (1, "exit code 3 (a message of the all-reduce was dropped)")


def test_added_latency_on_one_link_slows_every_rank_by_the_ring_formula(make_job):
    job = make_job()
    job.start()
    drive(job, lambda: events(job, "training"), "training")
    latency_s = 0.05
    delay_s = 2 * (2 - 1) * latency_s  # M = 2: two hops each pay the added latency
    begin = time.time()
    end = begin + 2.0
    write_control(job.control_file(0), [ActiveFault("latency", end, latency_s)])
    drive(job, lambda: time.time() > end + 0.5, "the latency fault to pass")
    job.stop()

    for rank in (0, 1):
        lines = [json.loads(line) for line in job.paths.rank_metrics(rank).read_text().splitlines()]
        during = [r[f"dp/{rank}/step_s"] for r in lines if f"dp/{rank}/step_s" in r and begin + 0.5 < r["time"] < end]
        assert during and min(during) >= delay_s, f"rank {rank} did not wait for the slowed link"
        assert len(during) <= 1.5 / delay_s + 1


def test_corrupted_gradients_reach_every_replica_alike(make_job):
    job = make_job()
    job.start()
    drive(job, lambda: events(job, "training"), "training")
    end = time.time() + 1.0
    write_control(job.control_file(1), [ActiveFault("corrupt", end, 1.0)])
    drive(job, lambda: time.time() > end and job.running and job.step > 0 and events(job, "training")[-1]
          ["attempt"] == events(job, "attempt_start")[-1]["attempt"], "the corrupt fault to pass")
    job.stop()

    log = (job.paths.logs / "rank-1-attempt-1.log").read_text()
    assert "corrupt fault: flipped byte" in log
    # Whatever a flip did, DDP applied the same averaged gradient on both ranks: the replicas stay equal, and a
    # non-finite result made every rank exit and the job restart.
    assert all(e["cause"] == "exit code 4 (non-finite loss or gradient)" for e in events(job, "failure"))
    status = [read_json(job.paths.rank_status(rank)) for rank in (0, 1)]
    assert status[0]["params_sha256"] == status[1]["params_sha256"]


# With make acceptance: the default suite took 940 s on 2 cores (2026-12-05); the other tests here run the baseline.
@pytest.mark.acceptance
def test_partitioned_rank_stalls_the_job_until_the_partition_heals(make_job):
    job = make_job(hang_timeout_s=3.0)
    job.start()
    drive(job, lambda: events(job, "training"), "training")
    end = time.time() + 5.0
    write_control(job.control_file(1), [ActiveFault("partition", end)])
    job.hold(1, end)  # what the chaos runner does: the job cannot restart without the partitioned rank
    failures = drive(job, lambda: events(job, "failure"), "the partition to stall the job")
    drive(job, lambda: events(job, "training")[1:], "the job to train after the partition")
    job.stop()

    assert [(e["rank"], e["cause"].split(" (")[0]) for e in failures] == [(1, "no progress for 3 s")]
    assert failures[0]["cause"].endswith("outside any collective)")
    assert events(job, "attempt_start")[1]["time"] >= end
