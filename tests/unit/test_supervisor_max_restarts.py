"""`SupervisorConfig.max_restarts` bounds restarts in a row that each failed soon after their start (a crash loop),
not every restart of a child's life: a long run whose syncer and learners are killed now and then (a preemption, the
OOM killer) goes on, and a child that fails at every start is still given up. Real processes (the fake `ddiloco` of
tests/fake_learners.py), real exits and signals."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from ddiloco.backoff import Backoff
from ddiloco.runtime.supervised_roles import ChildState, Slot
from ddiloco.runtime.supervisor import Supervisor
from tests.fake_learners import FAST, all_pids, assert_all_gone, make_run, poll_until

MAX_RESTARTS = 2
KILLS = MAX_RESTARTS + 2


def test_the_count_of_failures_in_a_row():
    slot = Slot("learner-0", 0, Backoff(0.5, 8.0))
    count = lambda code, ran_for_s: slot.count_exit(code, ran_for_s, stable_after_s=30.0)
    count(1, 2.0)
    count(4, 29.9)
    assert slot.failed_in_a_row == 2 and slot.restarts_exhausted(2, 30.0) is None
    count(-signal.SIGKILL, 1.0)  # a fault: neither counted nor a fresh start
    assert slot.failed_in_a_row == 2
    count(0, 1.0)  # a quick exit 0 that is restarted (stopped from outside) fails the start too
    assert slot.restarts_exhausted(2, 30.0) == "after 3 starts in a row that each failed within 30 s of their start"
    count(1, 30.0)  # a stable run: a fresh count, whatever ended it
    assert slot.failed_in_a_row == 0
    count(1, 1.0)
    count(-signal.SIGKILL, 3600.0)
    assert slot.failed_in_a_row == 0


@pytest.mark.parametrize(("stable_after_s", "run_s"), [(0.05, 0.05), (FAST.stable_after_s, 0.0)])
@pytest.mark.parametrize("role", ["syncer", "learner-0"])
def test_a_child_killed_by_a_signal_more_than_max_restarts_times_is_still_restarted(tmp_path, fake_command, role,
                                                                                    stable_after_s, run_s):
    # Each kill comes `run_s` into a start: after a stable run, or (60 s) a short one that only being a signal spares.
    launcher = make_run(tmp_path, fake_command, inner_steps=100_000)
    config = dataclasses.replace(FAST, max_restarts=MAX_RESTARTS, stable_after_s=stable_after_s)
    supervisor = Supervisor(config, launcher=launcher)
    slot = supervisor.syncer if role == "syncer" else supervisor.learners[0]
    supervisor.start()
    try:
        for kill in range(KILLS):
            poll_until(supervisor, lambda: slot.state == ChildState.RUNNING and slot.pid is not None
                       and time.monotonic() - slot.starting_since >= run_s,
                       f"{role} to run (start {kill + 1})")
            victim = slot.pid
            os.kill(victim, signal.SIGKILL)
            poll_until(supervisor, lambda victim=victim: slot.state == ChildState.FAILED
                       or (slot.pid not in (None, victim) and slot.state == ChildState.RUNNING),
                       f"{role} to be restarted or given up (kill {kill + 1})")
            assert slot.state == ChildState.RUNNING, f"given up after kill {kill + 1}: {slot.reason}"
        assert supervisor.failure is None
        assert slot.exit_codes == [-signal.SIGKILL] * KILLS and slot.restarts == KILLS
        assert slot.failed_in_a_row == 0
    finally:
        supervisor.shutdown()
    assert_all_gone(all_pids(supervisor))


def test_a_learner_failing_after_stable_runs_more_than_max_restarts_times_is_still_restarted(tmp_path,
                                                                                             fake_command):
    # Each start trains at least one 0.01 s step before it fails (a step further each time, so no crash loop of
    # `CrashLoop`'s either): every run is stable, each failure a fresh count.
    crashes = MAX_RESTARTS + 3
    plan = {"learners": {"0": {"crash_at_step": 3, "crashes": crashes}}}
    launcher = make_run(tmp_path, fake_command, learners=1, plan=plan)
    config = dataclasses.replace(FAST, max_restarts=MAX_RESTARTS, stable_after_s=0.01)
    supervisor = Supervisor(config, launcher=launcher)
    supervisor.run()
    (learner,) = supervisor.learners
    assert learner.state == ChildState.DONE, learner.reason
    assert learner.exit_codes == [1] * crashes + [0] and learner.restarts == crashes


def test_a_learner_failing_soon_after_every_start_is_given_up_after_max_restarts(tmp_path, fake_command):
    plan = {"learners": {"0": {"crash_at_step": 1, "crashes": 100}}}  # further each time: not `CrashLoop`'s
    launcher = make_run(tmp_path, fake_command, learners=1, plan=plan)
    supervisor = Supervisor(dataclasses.replace(FAST, max_restarts=MAX_RESTARTS), launcher=launcher)
    supervisor.run()
    (learner,) = supervisor.learners
    assert learner.state == ChildState.FAILED and learner.exit_codes == [1] * (MAX_RESTARTS + 1)
    assert learner.restarts == MAX_RESTARTS
    assert learner.reason == f"exit code 1 after {MAX_RESTARTS + 1} starts in a row that each failed within 60 s of " \
                             "their start"


def test_a_syncer_failing_soon_after_every_start_is_given_up_after_max_restarts(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, plan={"syncer": {"exit_code": 1, "message": "OSError: disk gone"}})
    supervisor = Supervisor(dataclasses.replace(FAST, max_restarts=MAX_RESTARTS), launcher=launcher)
    supervisor.run()
    assert supervisor.syncer.state == ChildState.FAILED
    assert supervisor.syncer.exit_codes == [1] * (MAX_RESTARTS + 1) and supervisor.syncer.restarts == MAX_RESTARTS
    assert supervisor.failure == (f"the syncer cannot run: OSError: disk gone (after {MAX_RESTARTS + 1} starts in a "
                                  "row that each failed within 60 s of their start)")
    assert supervisor.learners[0].pids == []
