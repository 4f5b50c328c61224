"""The one fault plan: which fault hits which process, when, for how long; shared by chaos runs and the harness.

A `FaultPlan` is a sorted tuple of `Fault`s. A chaos run (`ddiloco.chaos`) carries out every kind on real
processes; its plans come from a user file, a failure model or the fixed `--quick` plan
(`ddiloco.chaos.plan`). The virtual-time harness (`ddiloco.sim`) runs the same type, restricted to the
kind it simulates: a learner down for a while (`crash` with `restart` False, "an outage": `outages`,
`FaultPlan.of`), drawn by `ddiloco.sim.faults.draw_fault_plan`. Every system of a chaos run or an
experiment runs under one plan, so they face exactly the same faults. Plain data: what a fault costs is
the drivers' business, what it does to a process the chaos runner's. A plan may leave `duration_s` and
`num_learners` unset (the harness's plans: the run's length is set by its token budget).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checks import invalid
from ddiloco.fault_control import MAX_RUN_S, value_expected, value_valid

KINDS = ("crash", "hang", "straggler", "partition", "latency", "bandwidth", "drop", "corrupt", "syncer_crash")
TIMED_KINDS = ("hang", "straggler", "partition", "latency", "bandwidth", "drop", "corrupt")
"""Kinds that last a while and need duration_s > 0 (a crash needs one only with restart False)."""
VALUE_KEYS = {"straggler": "factor", "latency": "latency", "bandwidth": "bandwidth", "drop": "probability",
              "corrupt": "probability"}
"""The user-format key of the one parameter each kind takes (stored as Fault.value)."""
SYNCER = "syncer"


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault. Learner faults target a learner index; `syncer_crash` targets the syncer (None)."""

    at_s: float
    """Seconds after the system's launch at which the fault is injected."""
    kind: str
    target: int | None = None
    """Learner index (data-parallel: rank), or None for the syncer."""
    duration_s: float = 0.0
    """How long the fault lasts; 0 for an instantaneous one (a crash the supervisor restarts)."""
    restart: bool = True
    """crash only: True = the supervisor brings the learner back as usual; False = it stays down for
    duration_s (a machine being replaced), then comes back."""
    value: float | None = None
    """straggler factor, latency seconds, bandwidth bytes/s, drop/corrupt probability (`value_bounds`)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is unknown: expected one of {', '.join(KINDS)}")
        if not (isinstance(self.at_s, int | float) and math.isfinite(self.at_s) and self.at_s >= 0):
            raise invalid("at", self.at_s, "a time >= 0")
        if not (isinstance(self.duration_s, int | float) and math.isfinite(self.duration_s)
                and self.duration_s >= 0):
            raise invalid("duration", self.duration_s, "a time >= 0")
        if self.kind == "syncer_crash":
            if self.target is not None:
                raise ValueError(f"target={self.target!r} is invalid for syncer_crash: it targets the syncer only")
        elif not (isinstance(self.target, int) and not isinstance(self.target, bool) and self.target >= 0):
            raise ValueError(f"target={self.target!r} is invalid for {self.kind}: expected a learner "
                             "(learner-N or N)")
        if not self.restart and self.kind != "crash":
            raise ValueError(f"restart=false is invalid for {self.kind}: only a crash can keep a process down")
        timed = self.kind in TIMED_KINDS or (self.kind == "crash" and not self.restart)
        if timed and self.duration_s <= 0:
            what = "crash with restart false" if self.kind == "crash" else self.kind
            raise ValueError(f"duration is missing for {what}: expected a time > 0")
        if not timed and self.duration_s != 0:
            raise ValueError(f"duration={self.duration_s!r} is invalid for an instantaneous {self.kind}: "
                             "expected none (a crash held down needs restart: false)")
        if self.kind in VALUE_KEYS:
            check_value(self.kind, self.value)
        elif self.value is not None:
            raise ValueError(f"a value ({self.value!r}) is invalid for {self.kind}: it takes no parameter")

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    @property
    def is_outage(self) -> bool:
        """A learner down for a while (a machine being replaced): the one kind the harness simulates."""
        return self.kind == "crash" and not self.restart

    @property
    def target_name(self) -> str:
        return SYNCER if self.target is None else f"learner-{self.target}"

    def to_json(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "kind": self.kind, "target": self.target, "duration_s": self.duration_s,
                "restart": self.restart, "value": self.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fault:
        value = data.get("value")
        target = data.get("target")
        return cls(at_s=float(data["at_s"]), kind=str(data["kind"]), target=None if target is None else int(target),
                   duration_s=float(data.get("duration_s", 0.0)), restart=bool(data.get("restart", True)),
                   value=None if value is None else float(value))


def check_value(kind: str, value: float | None, run_s: float = MAX_RUN_S, *, run: str = "") -> None:
    """The parameter of a fault of `kind` must lie within its bounds for a run of `run_s` seconds
    (`ddiloco.fault_control.value_bounds`; `run` names where `run_s` came from, for the message)."""
    if not value_valid(kind, value, run_s):
        missing = " is missing" if value is None else f"={value!r} is invalid"
        raise ValueError(f"{VALUE_KEYS[kind]}{missing} for {kind}: expected {value_expected(kind, run_s, run=run)}")


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Every fault of a chaos run, sorted by start time (ties keep their given order)."""

    duration_s: float | None = None
    """How long each system runs, seconds from its launch (None: not bounded by the plan)."""
    num_learners: int | None = None
    """Learners (ranks) the targets must lie within (None: not bounded by the plan)."""
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    """Seeds the processes' drop and corrupt draws (and, for a drawn plan, the draw itself)."""
    source: str = ""
    """Where the plan came from: a file path, "quick", or "model"."""
    model: dict[str, Any] | None = field(default=None, compare=False)
    """Arguments of `model_plan` when the plan was drawn."""

    def __post_init__(self) -> None:
        if self.duration_s is not None and not (isinstance(self.duration_s, int | float)
                                                and math.isfinite(self.duration_s)
                                                and 0 < self.duration_s <= MAX_RUN_S):
            raise invalid("duration", self.duration_s, f"a time > 0 and at most {MAX_RUN_S:g} s (a week)")
        if self.num_learners is not None and not (isinstance(self.num_learners, int) and self.num_learners >= 1):
            raise invalid("num_learners", self.num_learners, "an integer >= 1")
        for index, fault in enumerate(self.faults):
            check_fits(fault, self.num_learners, self.duration_s, f"fault {index}")
        _check_outages_apart(self.faults)
        object.__setattr__(self, "faults", tuple(sorted(self.faults, key=lambda f: f.at_s)))

    # ---- the harness's view: outages ----

    @classmethod
    def of(cls, outages: Iterable[tuple[int, float, float]]) -> FaultPlan:
        """A plan of outages from (learner, start_s, end_s) triples: each a crash held down until end_s."""
        return cls(faults=tuple(outage(learner, start, end) for learner, start, end in outages))

    @property
    def outages(self) -> tuple[Fault, ...]:
        """The faults that keep a learner down for a while (crash with restart False), by start time."""
        return tuple(f for f in self.faults if f.is_outage)

    def for_learner(self, learner_id: int) -> list[Fault]:
        """Outages of learner `learner_id`, by start time."""
        return [f for f in self.outages if f.target == learner_id]

    def is_down(self, learner_id: int, time_s: float) -> bool:
        return any(f.at_s <= time_s < f.end_s for f in self.for_learner(learner_id))

    def down_s(self, learner_id: int, until_s: float) -> float:
        """Seconds learner `learner_id` is down within [0, until_s)."""
        return sum(max(0.0, min(f.end_s, until_s) - f.at_s) for f in self.for_learner(learner_id))

    def to_json(self) -> dict[str, Any]:
        return {"duration_s": self.duration_s, "num_learners": self.num_learners, "seed": self.seed,
                "source": self.source, "model": self.model, "faults": [f.to_json() for f in self.faults]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FaultPlan:
        duration, learners = data.get("duration_s"), data.get("num_learners")
        return cls(duration_s=None if duration is None else float(duration),
                   num_learners=None if learners is None else int(learners),
                   faults=tuple(Fault.from_json(f) for f in data["faults"]), seed=int(data.get("seed", 0)),
                   source=str(data.get("source", "")), model=data.get("model"))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return path


def _check_outages_apart(faults: tuple[Fault, ...]) -> None:
    """Two outages of one learner must not overlap: a learner is down or not, and `down_s` adds up its outages, so
    two that overlap would count the shared time twice. Faults are named by their index in `faults` (a plan
    file's order)."""
    last: dict[int, tuple[int, Fault]] = {}  # learner -> (index, fault) of its outage that ends last so far
    for index, fault in sorted(((i, f) for i, f in enumerate(faults) if f.is_outage), key=lambda p: p[1].at_s):
        assert fault.target is not None
        earlier = last.get(fault.target)
        if earlier is not None and fault.at_s < earlier[1].end_s:
            first, second = sorted((earlier[0], index))
            raise ValueError(
                f"faults {first} and {second} overlap: both keep learner-{fault.target} down (crash, restart false), "
                f"fault {index} from {fault.at_s:g} s, before fault {earlier[0]} ends at {earlier[1].end_s:g} s: "
                "expected the outages of one learner one after the other; merge them into one")
        if earlier is None or fault.end_s > earlier[1].end_s:
            last[fault.target] = (index, fault)


def check_fits(fault: Fault, num_learners: int | None, duration_s: float | None, where: str, *,
               run: str = "") -> None:
    """A fault must target one of the plan's learners, start while the system runs, last at most MAX_RUN_S, and
    take a parameter within its bounds for a run of `duration_s` (where they are set). `run` names where the
    duration came from (default: the plan's duration)."""
    if num_learners is not None and fault.target is not None and fault.target >= num_learners:
        raise ValueError(f"{where}: target learner-{fault.target} is beyond the run's {num_learners} learners: "
                         f"expected learner-0 .. learner-{num_learners - 1}")
    if duration_s is None:
        return
    run = run or f"the plan's duration of {duration_s:g}s"
    if fault.at_s >= duration_s:
        raise ValueError(f"{where}: at={fault.at_s:g}s is not before {run}: "
                         "expected a fault that starts while the system runs")
    if fault.duration_s > MAX_RUN_S:
        raise ValueError(f"{where}: duration={fault.duration_s:g}s is invalid: expected at most {MAX_RUN_S:g} s "
                         "(a week; a fault that outlasts the run ends at the stop)")
    if fault.kind in VALUE_KEYS:
        try:
            check_value(fault.kind, fault.value, duration_s, run=run)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc


def outage(learner_id: int, start_s: float, end_s: float) -> Fault:
    """Learner `learner_id` down on [start_s, end_s): a crash held down for the difference."""
    if not (isinstance(end_s, int | float) and math.isfinite(end_s) and end_s > start_s):
        raise invalid("end_s", end_s, f"a finite number > start_s={start_s!r}")
    return Fault(at_s=start_s, kind="crash", target=learner_id, duration_s=end_s - start_s, restart=False)
