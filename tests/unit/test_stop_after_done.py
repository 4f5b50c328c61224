"""A Ctrl-C that comes just as a learner finished: its session is over (its status file, written by the process the stop
ends, says done at its budget) and the process is on its way out when the SIGTERM reaches it, so it exits with the
stop's status (-15). Both supervisors report such a learner done, as its status says, not `stopped`.

The Ray supervisor's actors are doubles answering `stop()` as a role actor does (no Ray instance is started:
tests/integration/test_ray_run.py runs the real thing); the local supervisor stops a real process.
"""

from __future__ import annotations

import signal
import sys
import time

import pytest

from ddiloco.checkpoint import atomic_write_json
from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.ray_options import RayOptions
from ddiloco.runtime.ray_supervisor import RaySupervisor
from ddiloco.runtime.supervised_roles import ChildState, SupervisorConfig
from ddiloco.runtime.supervisor import Supervisor

INNER_STEPS = 20
STOP_TIMEOUT_S = 5.0


def write_status(launcher: Launcher, learner_id: int, state: str, inner_step: int) -> None:
    atomic_write_json(launcher.paths.learner_status(learner_id),
                      {"time": time.time(), "state": state, "inner_step": inner_step, "inner_steps": INNER_STEPS})


class StoppedActor:
    """A role actor whose `stop()` answers `code`, the exit status its process ended with."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.stop = self

    def remote(self, timeout_s: float) -> int:
        return self.code


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.wait / ray.get / ray.kill over `StoppedActor`s' answers (an answer is its own reference)."""
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: None)


def test_ray_a_learner_the_stop_found_done_is_done(tmp_path, fake_ray):
    events = []
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=2, threads=1, evaluator=False))
    supervisor = RaySupervisor(SupervisorConfig(), launcher=launcher, options=RayOptions(), on_event=events.append)
    finished, training = supervisor.learners
    for learner_id, slot in enumerate(supervisor.learners):
        supervisor._on_status(slot, {"name": slot.name, "incarnation": 0, "pid": 100 + learner_id, "node": "10.0.0.7",
                                     "worker_pid": 200 + learner_id, "address": None, "returncode": None,
                                     "previous_exit": None, "previous_log_tail": [], "log_tail": []},
                              now=time.monotonic())
        supervisor._actors[slot.name] = StoppedActor(-signal.SIGTERM)
    write_status(launcher, 0, "done", INNER_STEPS)
    write_status(launcher, 1, "training", 7)
    supervisor._stop([finished, training], STOP_TIMEOUT_S)
    assert finished.state == ChildState.DONE and training.state == ChildState.RUNNING  # shutdown() then: stopped
    stopped = {e.name: e.message for e in events if e.kind == "stopped"}
    assert stopped == {"learner-0": "stopped (exit -15) after its session had finished: done",
                       "learner-1": "stopped (exit -15)"}


def test_local_a_learner_the_stop_found_done_is_done(tmp_path):
    events = []
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=2, threads=1, evaluator=False))
    supervisor = Supervisor(SupervisorConfig(learner_stop_timeout_s=STOP_TIMEOUT_S), launcher=launcher,
                            on_event=events.append)
    for slot in supervisor.learners:
        # Python's default SIGTERM: the process ends with -15, as a learner past its session does.
        slot.process = launcher.start(slot.name, [sys.executable, "-c", "import time; time.sleep(60)"], 1)
        slot.state = ChildState.RUNNING
    write_status(launcher, 0, "done", INNER_STEPS)
    write_status(launcher, 1, "training", 7)
    supervisor.shutdown()
    assert [slot.state for slot in supervisor.learners] == [ChildState.DONE, ChildState.STOPPED]
    stopped = {e.name: e.message for e in events if e.kind == "stopped"}
    assert stopped == {"learner-0": "stopped (exit -15) after its session had finished: done",
                       "learner-1": "stopped (exit -15)"}
