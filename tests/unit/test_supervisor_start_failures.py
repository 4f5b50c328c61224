"""A learner in a crash loop is given up with its last log line as the reason, instead of crash-looping for minutes up
to `max_restarts`: one that cannot start its session (a script that fails at import, a model that cannot be built),
and one that fails at the same inner step at every restart. Real processes (the fake `ddiloco` of
tests/fake_learners.py), real exits and signals."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

import pytest
from rich.console import Console

from ddiloco.runtime.learner_exits import CrashLoop
from ddiloco.runtime.report import build_summary
from ddiloco.runtime.report_table import print_summary
from ddiloco.runtime.supervised_roles import ChildState
from ddiloco.runtime.supervisor import Supervisor
from tests.fake_learners import FAST, make_run, poll_until

IMPORT_ERROR = "ModuleNotFoundError: No module named 'my_model'"


def test_a_learner_failing_before_its_session_three_starts_in_a_row_is_given_up_with_its_error(tmp_path,
                                                                                               fake_command):
    plan = {"learners": {"1": {"exit_code": 1, "message": IMPORT_ERROR}}}
    launcher = make_run(tmp_path, fake_command, plan=plan)
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.run()
    ok, broken = supervisor.learners
    assert ok.state == ChildState.DONE
    assert broken.state == ChildState.FAILED and broken.exit_codes == [1, 1, 1] and broken.restarts == 2
    assert broken.reason.startswith(IMPORT_ERROR)
    assert "3 starts in a row ended before its session started" in broken.reason
    assert str(launcher.paths.log("learner-1")) in broken.reason
    (failed,) = [e for e in events if e.kind == "failed"]
    assert failed.learner_id == 1 and IMPORT_ERROR in failed.message


def test_a_start_that_reaches_its_session_resets_the_count(tmp_path, fake_command):
    # Two failed starts, then one that crashes at step 3, after its session began (not a third in a row), then one
    # that finishes.
    plan = {"learners": {"0": {"exit_code": 1, "failed_starts": 2, "crash_at_step": 3, "crashes": 3}}}
    launcher = make_run(tmp_path, fake_command, learners=1, plan=plan)
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    (learner,) = supervisor.learners
    assert learner.state == ChildState.DONE and learner.exit_codes == [1, 1, 1, 0]


def test_deaths_by_a_signal_before_the_session_are_faults_and_keep_being_restarted(tmp_path, fake_command):
    plan = {"learners": {"0": {"killed_starts": 3}}}
    launcher = make_run(tmp_path, fake_command, learners=1, plan=plan)
    supervisor = Supervisor(dataclasses.replace(FAST, max_exits_before_session=1), launcher=launcher)
    supervisor.run()
    (learner,) = supervisor.learners
    assert learner.state == ChildState.DONE
    assert learner.exit_codes == [-signal.SIGKILL] * 3 + [0] and learner.restarts == 3


def test_an_evaluator_failing_before_its_first_evaluation_is_given_up_and_the_run_goes_on(tmp_path, fake_command):
    # A script whose evaluator copy calls ddiloco.session: it was restarted with backoff until the run ended.
    error = "ValueError: this process is the run's evaluator"
    launcher = make_run(tmp_path, fake_command, inner_steps=300,  # 3 s: longer than the evaluator's three starts
                        plan={"evaluator": {"exit_code": 1, "message": error}})
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    evaluator = supervisor.evaluator
    assert evaluator is not None and evaluator.state == ChildState.FAILED and evaluator.exit_codes == [1, 1, 1]
    assert evaluator.reason.startswith(error) and "3 starts in a row ended before its first evaluation" in \
        evaluator.reason
    assert [learner.state for learner in supervisor.learners] == [ChildState.DONE, ChildState.DONE]


def test_an_evaluator_waiting_to_restart_when_the_run_ends_says_how_its_last_start_ended(tmp_path, fake_command):
    # A short run ended while its evaluator waited out its backoff: summary.json said `"state": "stopped", "reason":
    # null` and the console nothing, although every start had failed.
    error = "ValueError: my evaluate() is broken"
    launcher = make_run(tmp_path, fake_command, inner_steps=20,
                        plan={"evaluator": {"exit_code": 1, "message": error}})
    supervisor = Supervisor(dataclasses.replace(FAST, backoff_initial_s=60.0, backoff_max_s=60.0), launcher=launcher)
    supervisor.run()
    evaluator = supervisor.evaluator
    assert evaluator is not None and evaluator.state == ChildState.STOPPED and evaluator.exit_codes == [1]
    assert evaluator.reason == f"it was waiting to be started again: its last start exited with exit code 1: {error}"
    summary = build_summary(launcher.paths, num_learners=2, outcome="completed", wall_time_s=1.0,
                            evaluator=(str(evaluator.state), evaluator.reason))
    console = Console(width=400, record=True)
    print_summary(summary, console)
    assert (f"the evaluator did not evaluate the final model, so the run measured no validation loss: "
            f"{evaluator.reason}") in console.export_text()


SCHEDULER_ERROR = "ValueError: Tried to step 6 times. The specified number of total steps is 5"


def test_a_learner_failing_at_the_same_step_at_every_restart_is_given_up_with_its_error(tmp_path, fake_command):
    # Each restart resumes from the checkpoint at step 5 and fails there again (a scheduler stepped past its total
    # fails the same way from its saved state); before, it was restarted up to max_restarts (100) times.
    plan = {"learners": {"1": {"stuck_at_step": 5, "crash_message": SCHEDULER_ERROR}}}
    launcher = make_run(tmp_path, fake_command, plan=plan)
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.run()
    ok, stuck = supervisor.learners
    assert ok.state == ChildState.DONE
    # The first start trained to step 5 and failed there: progress. Three restarts then failed at step 5 again.
    assert stuck.state == ChildState.FAILED and stuck.exit_codes == [1, 1, 1, 1] and stuck.restarts == 3
    assert stuck.reason.startswith(SCHEDULER_ERROR)
    assert "3 restarts in a row failed without training past inner step 5, the last with exit code 1" in stuck.reason
    assert str(launcher.paths.log("learner-1")) in stuck.reason
    (failed,) = [e for e in events if e.kind == "failed"]
    assert failed.learner_id == 1 and SCHEDULER_ERROR in failed.message


def test_a_learner_that_trains_further_before_each_failure_keeps_being_restarted(tmp_path, fake_command):
    # It fails five times, each a step further than the last: a fault that passes, not a loop.
    plan = {"learners": {"0": {"crash_at_step": 3, "crashes": 5}}}
    launcher = make_run(tmp_path, fake_command, learners=1, plan=plan)
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    (learner,) = supervisor.learners
    assert learner.state == ChildState.DONE and learner.exit_codes == [1] * 5 + [0]


def test_the_crash_loop_counts():
    loop = CrashLoop()
    give_up = lambda: loop.give_up_reason(1, ["E: x"], tmp_log, max_before_session=2, max_without_progress=2)
    tmp_log = "DIR/logs/learner-0.log"
    loop.count(1, {"inner_step": 10})  # the first failure in a session: the furthest step so far
    assert (loop.without_progress, loop.furthest_step) == (0, 10) and give_up() is None
    loop.count(-signal.SIGKILL, {"inner_step": 10})  # a signal: where it got, not counted
    loop.count(1, {"inner_step": 8})  # resumed from an older checkpoint, failed before step 10
    assert loop.without_progress == 1 and give_up() is None
    loop.count(1, {"inner_step": 10})
    assert give_up() == ("E: x (2 restarts in a row failed without training past inner step 10, the last with exit "
                         "code 1; its log: DIR/logs/learner-0.log)")
    loop.count(1, {"inner_step": 11})  # further: a fresh count
    assert (loop.without_progress, loop.furthest_step) == (0, 11)
    loop.count(1, {})
    loop.count(1, {})  # no session twice
    assert give_up().startswith("E: x (2 starts in a row ended before its session started")
    assert CrashLoop.from_json(loop.as_json()) == loop
    assert CrashLoop.from_json(None) == CrashLoop() == CrashLoop.from_json({"before_session": "x"})


def test_a_start_that_fails_halfway_stops_what_it_started(tmp_path, fake_command, monkeypatch):
    # The syncer is up when the standby pool fails to fill: the run ends with the error, and the syncer with it.
    supervisor = Supervisor(FAST, launcher=make_run(tmp_path, fake_command))

    def fill_fails() -> None:
        raise OSError("cannot fork")

    monkeypatch.setattr(supervisor.standby, "fill", fill_fails)
    try:
        with pytest.raises(OSError, match="cannot fork"):
            supervisor.run()
        syncer = supervisor.syncer.process
        assert syncer is not None and syncer.poll() is not None
        assert supervisor.syncer.state == ChildState.STOPPED
    finally:
        for pid in supervisor.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("launcher_paused", [True, False])
def test_time_the_launcher_did_not_run_is_not_the_syncer_s_start_up(tmp_path, fake_command, launcher_paused):
    # The syncer serves after 4.5 s, its start-up timeout is 3 s. A launcher that did not run for 3.5 s of that (its
    # job stopped) killed it at its next poll: `no syncer.json after 3 s`. Without the pause, 3 s is 3 s.
    launcher = make_run(tmp_path, fake_command, learners=1, plan={"syncer": {"serve_after_s": 4.5}})
    supervisor = Supervisor(dataclasses.replace(FAST, syncer_start_timeout_s=3.0), launcher=launcher)
    supervisor.start()
    try:
        supervisor.poll()
        if launcher_paused:
            time.sleep(3.5)  # no poll: the launcher stopped
        poll_until(supervisor, lambda: supervisor.syncer.state != ChildState.STARTING, "the syncer to serve or fail")
        if launcher_paused:
            assert supervisor.syncer.state == ChildState.RUNNING and supervisor.syncer.exit_codes == []
        else:
            assert supervisor.syncer.exit_codes, "the start-up timeout killed it"
    finally:
        supervisor.shutdown()
