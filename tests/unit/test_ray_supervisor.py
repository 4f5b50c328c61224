"""`RaySupervisor` turns the statuses of its actors into the local supervisor's events and states (what the
live view, the summary and the exit code are made of). Statuses are fed in as the actors would answer
them; no Ray instance is started (tests/integration/test_ray_run.py runs the real thing)."""

from __future__ import annotations

import signal

import pytest

from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.ray_options import RayOptions
from ddiloco.runtime.ray_supervisor import RaySupervisor
from ddiloco.runtime.supervised_roles import ChildState, SupervisorConfig


@pytest.fixture
def supervised(tmp_path):
    events = []
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=2, threads=1, evaluator=False))
    supervisor = RaySupervisor(SupervisorConfig(), launcher=launcher, options=RayOptions(), on_event=events.append)
    return supervisor, events


def status(name: str, incarnation: int, pid: int, *, returncode=None, previous_exit=None, address=None) -> dict:
    return {"name": name, "incarnation": incarnation, "pid": pid, "node": "10.0.0.7", "worker_pid": pid + 1000,
            "address": address, "returncode": returncode, "previous_exit": previous_exit,
            "previous_log_tail": ["Killed"] if previous_exit is not None else [], "log_tail": ["last line"]}


def kinds(events, name: str) -> list[str]:
    return [event.kind for event in events if event.name == name]


def test_a_new_incarnation_is_an_exit_a_restart_and_a_start(supervised):
    supervisor, events = supervised
    slot = supervisor.learners[1]
    supervisor._on_status(slot, status("learner-1", 0, 101), now=1.0)
    assert slot.state == ChildState.RUNNING and slot.pid == 101 and slot.restarts == 0
    supervisor._on_status(slot, status("learner-1", 1, 202, previous_exit=-signal.SIGKILL), now=2.0)
    assert slot.pid == 202 and slot.restarts == 1 and slot.pids == [101, 202]
    assert kinds(events, "learner-1") == ["started", "exited", "restart_scheduled", "started"]
    exited = next(e for e in events if e.kind == "exited")
    assert exited.message == "exited with signal SIGKILL"
    assert events[-1].fields["pid"] == 202  # `ddiloco run` records every pid a role had


def test_restarts_the_driver_did_not_see_are_counted(supervised):
    supervisor, events = supervised
    slot = supervisor.learners[0]
    supervisor._on_status(slot, status("learner-0", 0, 101), now=1.0)
    supervisor._on_status(slot, status("learner-0", 3, 404, previous_exit=1), now=9.0)
    assert slot.restarts == 3
    assert kinds(events, "learner-0").count("restart_scheduled") == 3  # what summary.json counts


def test_kept_exits_end_the_role_as_the_local_supervisor_would(supervised):
    supervisor, events = supervised
    done, refused = supervisor.learners
    supervisor._on_status(done, status("learner-0", 0, 101, returncode=0), now=1.0)
    supervisor._on_status(refused, status("learner-1", 0, 102, returncode=3), now=1.0)
    assert done.state == ChildState.DONE and refused.state == ChildState.REFUSED
    assert refused.reason == "last line" and done.pid is None
    assert supervisor.finished and supervisor.failure is None


def test_the_syncer_serving_gives_its_address_and_a_refused_syncer_fails_the_run(supervised):
    supervisor, events = supervised
    syncer = supervisor.syncer
    supervisor._on_status(syncer, status("syncer", 0, 100), now=1.0)
    assert syncer.state == ChildState.STARTING and supervisor.syncer_address is None
    supervisor._on_status(syncer, status("syncer", 0, 100, address="10.0.0.7:50051"), now=2.0)
    assert syncer.state == ChildState.RUNNING and supervisor.syncer_address == "10.0.0.7:50051"
    assert kinds(events, "syncer") == ["started", "address"]
    supervisor._on_status(syncer, status("syncer", 0, 100, address="10.0.0.7:50051", returncode=2), now=3.0)
    assert syncer.state == ChildState.FAILED and supervisor.finished
    assert supervisor.failure == "the syncer cannot run: last line"


def test_the_learner_rules_verdicts_end_the_role_as_the_local_supervisor_would(supervised):
    # The actor applies `learner_exits` (a crash after a finished session is done; the last of the starts in a row
    # that ended before their session fails the learner) and says so in `verdict`; the code alone would restart it.
    supervisor, events = supervised
    aborted, broken = supervisor.learners
    supervisor._on_status(aborted, status("learner-0", 0, 101), now=1.0)
    supervisor._on_status(aborted, {**status("learner-0", 0, 101, returncode=-signal.SIGABRT), "verdict": "done"},
                          now=2.0)
    supervisor._on_status(broken, status("learner-1", 2, 303, previous_exit=1), now=1.0)
    reason = "ModuleNotFoundError: No module named 'my_model' (3 starts in a row ended before its session started)"
    supervisor._on_status(broken, {**status("learner-1", 2, 303, returncode=1), "verdict": "failed", "reason": reason},
                          now=2.0)
    assert aborted.state == ChildState.DONE and aborted.exit_codes == [-signal.SIGABRT] and aborted.restarts == 0
    done = [e for e in events if e.kind == "done"]
    assert [e.name for e in done] == ["learner-0"]
    assert done[0].message == "exited with signal SIGABRT after its session had finished: done, not restarted"
    assert broken.state == ChildState.FAILED and broken.reason == reason and broken.exit_codes == [1, 1]
    assert supervisor.finished and supervisor.failure is None
