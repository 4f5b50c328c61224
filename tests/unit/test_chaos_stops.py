"""How `ddiloco chaos` ends when it is told to stop or loses its stdout: SIGTERM like Ctrl-C (every hang lifted, every
process stopped, exit 128 + the signal), a Ctrl-C before the plan started, the report of the systems that had
finished, and a closed stdout (`| head`) that must not end the run.

The command runs in this process (`ddiloco.cli.main`) against stand-ins for the runtime's supervisor and the
data-parallel job whose targets are real `sleep` processes: a hang SIGSTOPs one for real, and the signals are real,
sent by the stand-in's `poll` once the run has reached the state the test needs (never after a sleep).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddiloco import interrupts
from ddiloco.chaos import analysis, fault_injector, invariants, runner
from ddiloco.cli import main
from ddiloco.fault_plan import Fault, FaultPlan
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import process_state, wait_process_stopped

NUM_LEARNERS = 2
STATE_WAIT_S = 5.0
"""Longest wait for the kernel to show a signalled process's new state."""
RUN_LIMIT_S = 20.0
"""A stand-in's poll fails the test past this: the command should have ended long before."""
HANG_PLAN = "duration: 30s\nfaults:\n  - {at: 0.2s, kind: hang, target: learner-1, duration: 60s}\n"
SHORT_PLAN = ("duration: 1s\nfaults:\n  - {at: 0.1s, kind: latency, target: learner-0, duration: 0.2s, latency: 10ms}\n"
              "  - {at: 0.4s, kind: straggler, target: learner-1, duration: 0.2s, factor: 2}\n")
ANALYSED = {"goodput": 0.9, "uptime": 0.8, "final_val_loss": 3.0, "rounds_per_min": 6.0, "progress_unit": "rounds",
            "bytes": 1000, "faults": [], "restarts": 0, "val_loss": [[1.0, 3.5], [2.0, 3.0]], "progress": [[1.0, 1]],
            "window_s": 10.0}
"""What the analysis of one finished system returns, for tests whose systems are stand-ins that log nothing."""


class SignalNotHandled(Exception):
    pass


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """One process per learner, each leading its own group, as every chaos target does."""
    processes = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(NUM_LEARNERS)]
    yield [p.pid for p in processes]
    for process in processes:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(timeout=STATE_WAIT_S)


@pytest.fixture
def sigterm_guard() -> Iterator[None]:
    """A SIGTERM that the command does not handle fails the test (Python's default would end pytest)."""

    def unhandled(signum: int, frame: object) -> None:
        raise SignalNotHandled("SIGTERM reached the test's handler: ddiloco chaos installed none")

    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


@dataclass
class _Slot:
    pid: int | None
    learner_id: int | None = None
    state: str = "running"
    reason: str = ""


class FakeSupervisor:
    """The runtime's supervisor, as `run_runtime_system` uses it: learner slots on the sleepers; `poll` calls
    `on_poll`. With `ready`, `start` writes the learner statuses that say training has begun."""

    def __init__(self, pids: list[int], paths: RunPaths, on_poll: Callable[[], None], *, ready: bool) -> None:
        self.learners = [_Slot(pid, learner_id=i) for i, pid in enumerate(pids)]
        self.syncer = _Slot(None)
        self.failure = None
        self.paths, self.on_poll, self.ready = paths, on_poll, ready
        self.shut_down = False
        self.deadline = time.monotonic() + RUN_LIMIT_S

    def start(self) -> None:
        for slot in self.learners if self.ready else ():
            status = self.paths.learner_status(slot.learner_id)
            status.parent.mkdir(parents=True, exist_ok=True)
            status.write_text(json.dumps({"inner_step": 1}))

    def poll(self) -> None:
        assert time.monotonic() < self.deadline, "the command did not end"
        self.on_poll()

    def hold(self, slot: _Slot, until: float) -> None:
        pass

    @property
    def pids(self) -> list[int]:
        return [slot.pid for slot in self.learners if slot.pid is not None]

    def shutdown(self) -> None:
        self.shut_down = True


class FakeJob:
    """The data-parallel job, as `run_data_parallel_system` uses it: rank R is sleeper R."""

    def __init__(self, pids: list[int], root: Path, on_poll: Callable[[], None], *, ready: bool) -> None:
        self._pids = dict(enumerate(pids))
        self.root, self.on_poll, self.ready = root, on_poll, ready
        self.started = False
        self.training_started_at: float | None = None
        self.failure = None
        self.step = self.failures = 0
        self.standby_pids: list[int] = []
        self.shut_down = False
        self.deadline = time.monotonic() + RUN_LIMIT_S

    def start(self) -> None:
        self.started = True
        self.training_started_at = time.time() if self.ready else None

    def poll(self) -> None:
        assert time.monotonic() < self.deadline, "the command did not end"
        self.on_poll()

    def pids(self) -> dict[int, int]:
        return self._pids

    def hold(self, rank: int, until: float) -> None:
        pass

    def control_file(self, rank: int) -> Path:
        return self.root / "ranks" / str(rank) / "control.json"

    def stop(self) -> None:
        self.shut_down = True


def _stand_in(monkeypatch, system: str, pids: list[int], on_poll: Callable[[], None], *, ready: bool) -> list:
    """Replace `system`'s processes with the stand-in; the list gets it once the command makes it."""
    made: list = []
    if system == "data_parallel":
        from ddiloco.chaos import data_parallel

        def job(config, *, run_config, job_dir):
            made.append(FakeJob(pids, Path(job_dir), on_poll, ready=ready))
            return made[0]

        monkeypatch.setattr(data_parallel, "DataParallelJob", job)
    else:
        from ddiloco.runtime import supervisor

        def make(config, *, launcher, on_event):
            made.append(FakeSupervisor(pids, RunPaths(launcher.config.run_dir), on_poll, ready=ready))
            return made[0]

        monkeypatch.setattr(supervisor, "Supervisor", make)
    return made


def _chaos(tmp_path: Path, plan: str, *flags: str) -> int:
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(plan)
    try:
        return main(["chaos", "--plan", str(plan_file), "--learners", str(NUM_LEARNERS), "--run-dir",
                     str(tmp_path / "run"), *flags])
    except KeyboardInterrupt:  # escaping, it would end the whole pytest session
        pytest.fail("a KeyboardInterrupt escaped ddiloco chaos")


def _faults(system_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (system_dir / "chaos" / "faults.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("system", ["decoupled", "data_parallel"])
def test_sigterm_during_a_hang_lifts_it_stops_everything_and_exits_143(tmp_path, monkeypatch, capsys, sleepers,
                                                                      sigterm_guard, system):
    # /tmp/probe_chaos term1: a 60 s hang of learner-1 in force, then SIGTERM to ddiloco chaos.
    def terminate_once_hung() -> None:
        if process_state(sleepers[1]) == "T":
            os.kill(os.getpid(), signal.SIGTERM)

    made = _stand_in(monkeypatch, system, sleepers, terminate_once_hung, ready=True)
    assert _chaos(tmp_path, HANG_PLAN, "--systems", system) == 128 + signal.SIGTERM
    assert wait_process_stopped(sleepers[1], stopped=False, timeout_s=STATE_WAIT_S), \
        "the hung learner was left stopped"
    assert made[0].shut_down
    [hang] = _faults(tmp_path / "run" / system)
    assert hang["ended"] is not None and hang["ended"] < hang["started"] + 60 and "cut short" in hang["note"]
    record = json.loads((tmp_path / "run" / system / "chaos" / "run.json").read_text())
    assert record["interrupted"] == "SIGTERM"
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("system", ["decoupled", "data_parallel"])
def test_ctrl_c_before_the_plan_started_stops_everything_and_exits_130(tmp_path, monkeypatch, capsys, sleepers,
                                                                      system):
    # /tmp/probe_chaos int1: a Ctrl-C while the processes are still starting (FileNotFoundError: faults.jsonl.tmp).
    made = _stand_in(monkeypatch, system, sleepers, lambda: os.kill(os.getpid(), signal.SIGINT), ready=False)
    assert _chaos(tmp_path, HANG_PLAN, "--systems", system) == 128 + signal.SIGINT
    assert made[0].shut_down
    [hang] = _faults(tmp_path / "run" / system)
    assert hang["started"] is None and "not reached" in hang["note"]
    assert json.loads((tmp_path / "run" / system / "chaos" / "run.json").read_text())["interrupted"] == "SIGINT"
    captured = capsys.readouterr()
    assert "interrupted" in captured.err and "Traceback" not in captured.err
    assert "nothing to compare" in captured.out


def test_after_a_ctrl_c_the_systems_that_finished_are_reported_as_a_partial_comparison(tmp_path, monkeypatch, capsys):
    # Ctrl-C during data_parallel of decoupled,data_parallel,sync_diloco: decoupled had finished.
    def finished(system, system_dir, *args, **kwargs) -> dict:
        (system_dir / "chaos").mkdir(parents=True)
        return {}

    def interrupted(*args, **kwargs) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_runtime_system", finished)
    monkeypatch.setattr(runner, "run_data_parallel_system", interrupted)
    monkeypatch.setattr(analysis, "analyze_system", lambda system_dir, **kwargs: dict(ANALYSED))
    monkeypatch.setattr(invariants, "check_invariants", lambda system_dir: {"check": {"ok": True, "detail": ""}})
    assert _chaos(tmp_path, HANG_PLAN, "--systems", "decoupled,data_parallel,sync_diloco",
                  "--json") == 128 + signal.SIGINT
    run_dir = tmp_path / "run"
    expected = {"signal": "SIGINT", "cut_short": "data_parallel", "not_run": ["sync_diloco"]}
    results = json.loads((run_dir / "results.json").read_text())
    assert set(results["systems"]) == {"decoupled"} and results["interrupted"] == expected
    report = (run_dir / "report.md").read_text()
    assert "Partial comparison" in report and "during data_parallel" in report and "not run: sync_diloco" in report
    last_line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last_line["interrupted"] == expected and set(last_line["systems"]) == {"decoupled"}


def test_a_closed_stdout_ends_neither_the_run_nor_its_faults(tmp_path, monkeypatch, sleepers):
    # /tmp/probe_chaos pipe1: `ddiloco chaos ... | head -3` (BrokenPipeError from the console line of a fault).
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as closed_stdout:
        monkeypatch.setattr(sys, "stdout", closed_stdout)
        made = _stand_in(monkeypatch, "decoupled", sleepers, lambda: None, ready=True)
        monkeypatch.setattr("ddiloco.runtime.report.write_report", lambda *args, **kwargs: {})
        monkeypatch.setattr(analysis, "analyze_system", lambda system_dir, **kwargs: dict(ANALYSED))
        monkeypatch.setattr(invariants, "check_invariants", lambda system_dir: {"check": {"ok": True, "detail": ""}})
        assert _chaos(tmp_path, SHORT_PLAN, "--systems", "decoupled") == 0
    assert made[0].shut_down
    faults = _faults(tmp_path / "run" / "decoupled")
    assert [f["kind"] for f in faults if f["started"] is not None] == ["latency", "straggler"]
    assert (tmp_path / "run" / "report.md").is_file()


def test_a_second_signal_during_the_lift_still_lets_every_hang_end(tmp_path, sleepers, sigterm_guard):
    # A SIGTERM right after a Ctrl-C, while the stop lifts the faults: it must not leave the hung target stopped.
    class TermDuringLift:
        def pids(self, target: str) -> list[int]:
            return [sleepers[1]]

        def control_file(self, target: str) -> Path:
            if (tmp_path / "latency").exists():  # the latency's lift, which comes before the hang's
                os.kill(os.getpid(), signal.SIGTERM)
            (tmp_path / "latency").touch()
            return tmp_path / "control.json"

        def hold(self, target: str, until: float) -> None:
            pass

        def partitioned(self, target: str, until: float) -> None:
            pass

    plan = FaultPlan(duration_s=30.0, num_learners=NUM_LEARNERS, faults=(
        Fault(at_s=0.0, kind="latency", target=0, duration_s=60.0, value=0.01),
        Fault(at_s=0.0, kind="hang", target=1, duration_s=60.0)))
    injector = fault_injector.FaultInjector(plan, TermDuringLift(), tmp_path / "chaos" / "faults.jsonl",
                                            say=lambda line: None)
    injector.start(time.time())
    injector.tick()
    assert wait_process_stopped(sleepers[1], stopped=True, timeout_s=STATE_WAIT_S)
    stopped: list[bool] = []
    with interrupts.stop_signals_raise(), pytest.raises(interrupts.Stopped) as raised:
        runner._stop(injector, time.time(), lambda: stopped.append(True))
    assert raised.value.signum == signal.SIGTERM and interrupts.exit_code(raised.value) == 143
    assert wait_process_stopped(sleepers[1], stopped=False, timeout_s=STATE_WAIT_S), \
        "the second signal left the hung target stopped"
    assert stopped == [True]
