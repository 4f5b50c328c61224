"""The chaos runner's fault bookkeeping (`FaultInjector`), on a clock the test moves and real processes: overlapping
hangs of one target, and the record of faults that the stop cuts short."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from ddiloco.chaos.fault_injector import FaultInjector
from ddiloco.fault_control import ChaosControl, control_path
from ddiloco.fault_plan import Fault, FaultPlan
from tests.helpers import process_state, wait_process_stopped

STATE_WAIT_S = 5.0
"""Longest wait for the kernel to show a signalled process's new state."""


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTargets:
    """One real process per learner target; records holds."""

    def __init__(self, root: Path, pids: dict[str, int]) -> None:
        self.root = root
        self._pids = pids
        self.holds: list[tuple[str, float]] = []

    def pids(self, target: str) -> list[int]:
        return [self._pids[target]] if target in self._pids else []

    def hold(self, target: str, until: float) -> None:
        self.holds.append((target, until))

    def control_file(self, target: str) -> Path:
        return control_path(self.root / target)

    def partitioned(self, target: str, until: float) -> None:
        pass


@pytest.fixture
def sleeper():
    """A process leading its own group, as every chaos target does."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield process.pid
    process.send_signal(signal.SIGCONT)
    process.kill()
    process.wait(timeout=STATE_WAIT_S)


def _injector(tmp_path: Path, plan: FaultPlan, pids: dict[str, int], t0: float) -> tuple[FaultInjector, Clock]:
    clock = Clock(t0)
    injector = FaultInjector(plan, FakeTargets(tmp_path, pids), tmp_path / "chaos" / "faults.jsonl", clock=clock,
                             say=lambda line: None)
    injector.start(t0)
    return injector, clock


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "chaos" / "faults.jsonl").read_text().splitlines()]


def test_a_target_stays_stopped_until_the_last_hang_in_force_on_it_ends(tmp_path, sleeper):
    # /tmp/probe_chaos/nested.yaml: learner 0 hung 5-20 s and, inside that, 8-10 s. The inner hang's end must not
    # resume it: it trained again from 10 s.
    plan = FaultPlan(duration_s=25.0, num_learners=2, faults=(
        Fault(at_s=5.0, kind="hang", target=0, duration_s=15.0),
        Fault(at_s=8.0, kind="hang", target=0, duration_s=2.0)))
    injector, clock = _injector(tmp_path, plan, {"learner-0": sleeper}, 1000.0)
    for now in (1005.0, 1008.0):
        clock.now = now
        injector.tick()
    assert wait_process_stopped(sleeper, stopped=True, timeout_s=STATE_WAIT_S)
    clock.now = 1010.5
    injector.tick()  # the inner hang ends
    # SIGCONT wakes a stopped process inside kill(2) itself: had one been sent, the state would show it now.
    assert process_state(sleeper) == "T", "the inner hang's end resumed a target another hang still holds"
    clock.now = 1020.5
    injector.tick()  # the outer hang ends
    assert wait_process_stopped(sleeper, stopped=False, timeout_s=STATE_WAIT_S)
    assert [r["ended"] for r in _records(tmp_path)] == [1020.5, 1010.5]


def test_the_stop_lifts_a_hang_and_records_when_it_was_lifted(tmp_path, sleeper):
    # A Ctrl-C (or the plan's end) at 13 s during a 100 s hang from 12 s: the hang ended at the stop, not at 112 s.
    plan = FaultPlan(duration_s=20.0, num_learners=2, faults=(Fault(at_s=12.0, kind="hang", target=0,
                                                                    duration_s=100.0),))
    injector, clock = _injector(tmp_path, plan, {"learner-0": sleeper}, 1000.0)
    clock.now = 1012.0
    injector.tick()
    assert wait_process_stopped(sleeper, stopped=True, timeout_s=STATE_WAIT_S)
    clock.now = 1013.0
    injector.finish()
    assert wait_process_stopped(sleeper, stopped=False, timeout_s=STATE_WAIT_S)
    [record] = _records(tmp_path)
    assert record["started"] == 1012.0 and record["ended"] == 1013.0


def test_faults_that_outlive_the_run_are_recorded_as_ended_at_the_stop(tmp_path):
    # /tmp/probe_chaos/pastend.yaml: a 20 s run, a 100 s hang at 12 s, a crash held down 100 s from 14 s.
    plan = FaultPlan(duration_s=20.0, num_learners=2, faults=(
        Fault(at_s=12.0, kind="hang", target=0, duration_s=100.0),
        Fault(at_s=14.0, kind="crash", target=1, duration_s=100.0, restart=False),
        Fault(at_s=15.0, kind="partition", target=0, duration_s=100.0)))
    injector, clock = _injector(tmp_path, plan, {}, 1000.0)
    for now in (1012.0, 1014.0, 1015.0):
        clock.now = now
        injector.tick()
    clock.now = 1020.2
    injector.finish(at=1020.0)
    assert [(r["kind"], r["started"], r["ended"]) for r in _records(tmp_path)] == [
        ("hang", 1012.0, 1020.0), ("crash", 1014.0, 1020.0), ("partition", 1015.0, 1020.0)]
    assert [r["ended"] for r in injector.executed] == [1020.0, 1020.0, 1020.0]
    assert ChaosControl(control_path(tmp_path / "learner-0"), clock=clock).active() == {}

