"""Carrying out a fault plan against one running system: the `FaultInjector` and the `Targets` it acts on.

The `FaultInjector` turns the plan's faults into real actions at their times:

- process faults with signals to the target's process group: `crash` (SIGKILL; with `restart: false`
  the target is first held down for the fault's duration, like a machine being replaced), `hang`
  (SIGSTOP, SIGCONT at the end; a process two hangs stopped runs again only when the last one in force
  ends), `syncer_crash` (SIGKILL of the syncer; for data-parallel training it is the job's coordinator,
  rank 0, which hosts the rendezvous store);
- in-process faults (`partition`, `latency`, `bandwidth`, `drop`, `corrupt`, `straggler`) through
  the target's control file (`ddiloco.fault_control`), which the target's transport and training
  loop obey. A partitioned data-parallel rank is also held: the job cannot restart without it.

Every executed fault is written to `SYSTEM_DIR/chaos/faults.jsonl` when it fires (so a crashed
runner still leaves the record), with its planned end; the file is rewritten when a fault is lifted
and at the stop, so that "ended" is when the fault actually ended: a hang's SIGCONT, an in-process
fault's removal, or the stop for any fault (a held-down crash included) that would have outlived the
run. Which processes a target names, and how it is held down, is the running system's (`Targets`; the drivers in
`ddiloco.chaos.runner` implement it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ddiloco.chaos.plan import Fault, FaultPlan
from ddiloco.fault_control import IN_PROCESS_KINDS, ActiveFault, write_control


class Targets(Protocol):
    """What the injector needs from a running system."""

    def pids(self, target: str) -> list[int]:
        """Process group ids of the target's live processes (each child leads its own group)."""
        ...

    def hold(self, target: str, until: float) -> None:
        """Keep the target from being restarted before wall time `until`."""
        ...

    def control_file(self, target: str) -> Path:
        ...

    def partitioned(self, target: str, until: float) -> None:
        """The target is cut off until wall time `until` (data-parallel: the job cannot restart without it)."""
        ...


@dataclass
class _Lift:
    at: float
    target: str
    fault: Fault
    record: dict[str, Any]
    """The fault's entry in the log, whose "ended" the lift sets."""
    pids: list[int] = field(default_factory=list)
    active: ActiveFault | None = None


class FaultInjector:
    """Carries out a plan against one running system. Call `start(t0)`, then `tick()` often, then `finish()`."""

    def __init__(self, plan: FaultPlan, targets: Targets, log_path: Path, *,
                 clock: Callable[[], float] = time.time, say: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.targets = targets
        self.log_path = Path(log_path)
        self.clock = clock
        self.say = say
        self.t0: float | None = None
        self._due = list(enumerate(plan.faults))
        self._lifts: list[_Lift] = []
        self._active: dict[str, list[ActiveFault]] = {}
        self.executed: list[dict[str, Any]] = []

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")

    def tick(self) -> None:
        assert self.t0 is not None, "start() first"
        now = self.clock()
        for lift in [lift for lift in self._lifts if lift.at <= now]:
            self._lift(lift, now)
        while self._due and self.t0 + self._due[0][1].at_s <= now:
            index, fault = self._due.pop(0)
            self._fire(index, fault, now)

    def finish(self, at: float | None = None) -> None:
        """Lift every fault still in force (a stopped process must not stay stopped), end the record of every
        fault that would have outlived the run at the stop, wall time `at` (default: now), and record the
        faults the run did not reach."""
        stop = self.clock() if at is None else at
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # a run stopped before its plan started: no start()
        for lift in list(self._lifts):
            if lift.at > stop:
                lift.record["note"] = _join(lift.record["note"], "cut short by the stop")
            self._lift(lift, stop)
        for record in self.executed:
            if record["ended"] is not None and record["ended"] > stop:  # a crash held down past the stop
                record["ended"] = max(record["started"], stop)
                record["note"] = _join(record["note"], "cut short by the stop")
        for index, fault in self._due:
            self._record(index, fault, started=None, ended=None, pids=[], note="not reached: the run ended first")
        self._due = []
        self._write_log()

    # ---- firing and lifting ------------------------------------------------------------------------

    def _fire(self, index: int, fault: Fault, now: float) -> None:
        target = fault.target_name
        end = now + fault.duration_s
        pids: list[int] = []
        note = ""
        if fault.kind in ("crash", "syncer_crash"):
            if fault.kind == "crash" and not fault.restart:
                self.targets.hold(target, end)
            pids = self.targets.pids(target)
            self._signal(pids, signal.SIGKILL)
            if fault.kind == "syncer_crash" or fault.restart:
                end = now
        elif fault.kind == "hang":
            pids = self.targets.pids(target)
            self._signal(pids, signal.SIGSTOP)
        elif fault.kind in IN_PROCESS_KINDS:
            active = ActiveFault(fault.kind, end, fault.value)
            self._active.setdefault(target, []).append(active)
            write_control(self.targets.control_file(target), self._active[target])
            if fault.kind == "partition":
                self.targets.partitioned(target, end)
        else:  # FaultPlan validates kinds; a new kind must be taught here
            raise ValueError(f"fault kind {fault.kind!r} has no injector")
        if not pids and fault.kind in ("crash", "syncer_crash", "hang"):
            note = f"{target} was not running: nothing to signal"
        record = self._record(index, fault, started=now, ended=end, pids=pids, note=note)
        if fault.kind == "hang":
            self._lifts.append(_Lift(end, target, fault, record, pids=pids))
        elif fault.kind in IN_PROCESS_KINDS:
            self._lifts.append(_Lift(end, target, fault, record, active=active))
        offset = now - (self.t0 or now)
        suffix = f"  ({note})" if note else ""
        self.say(f"  t={offset:6.1f} s  {fault.kind:<12} {target:<10} {_describe(fault)}{suffix}")

    def _lift(self, lift: _Lift, now: float) -> None:
        self._lifts.remove(lift)
        if lift.fault.kind == "hang":
            # Hangs may overlap: a process another hang in force stopped stays stopped until that one ends.
            held = {pid for other in self._lifts if other.fault.kind == "hang" for pid in other.pids}
            self._signal([pid for pid in lift.pids if pid not in held], signal.SIGCONT)
        elif lift.active is not None:
            remaining = [a for a in self._active.get(lift.target, []) if a is not lift.active]
            self._active[lift.target] = remaining
            write_control(self.targets.control_file(lift.target), remaining)
        lift.record["ended"] = now
        self._write_log()

    @staticmethod
    def _signal(pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)

    def _record(self, index: int, fault: Fault, *, started: float | None, ended: float | None, pids: list[int],
                note: str) -> dict[str, Any]:
        entry = {"index": index, "kind": fault.kind, "target": fault.target_name, "at_s": fault.at_s,
                 "duration_s": fault.duration_s, "restart": fault.restart, "value": fault.value,
                 "started": started, "ended": ended, "pids": pids, "note": note}
        self.executed.append(entry)
        self._write_log()
        return entry

    def _write_log(self) -> None:
        """Rewrite the log whole (temp file + rename: a reader, or a runner killed meanwhile, never leaves half)."""
        tmp = self.log_path.with_name(self.log_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(entry) + "\n" for entry in self.executed), encoding="utf-8")
        os.replace(tmp, self.log_path)


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def _describe(fault: Fault) -> str:
    parts = []
    if fault.duration_s:
        parts.append(f"for {fault.duration_s:g} s")
    if fault.kind == "crash":
        parts.append("supervisor restarts it" if fault.restart else "held down")
    if fault.value is not None:
        parts.append({"straggler": "x{:g}", "latency": "+{:g} s", "bandwidth": "{:.3g} B/s"}.get(
            fault.kind, "p={:g}").format(fault.value))
    return ", ".join(parts)
