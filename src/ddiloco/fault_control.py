"""The control file through which a chaos run switches faults on and off inside a running process.

Faults that live in a process's own transport or training loop (a partition, added latency, a
bandwidth cap, dropped or corrupted messages, a slowed learner) cannot be injected from outside
without root. The chaos runner writes them, with their end times, into one small JSON file per
target; the target process, started with `--chaos-control PATH`, polls that file (at most every
`refresh_s`, by its modification time) and obeys whatever is active:

    {"faults": [{"kind": "partition", "until": 1764530000.0},
                {"kind": "latency", "until": 1764530020.0, "latency_s": 0.2}]}

`until` is wall time (`time.time()`, the same clock in every process of one machine). A fault past
its `until` is over even if the file still lists it, so a runner that dies cannot leave a process
partitioned for ever. An absent, empty or unreadable file means "no faults".

Faults of one kind may overlap (a chaos plan allows it); they combine (`strongest`): a process is
partitioned while any partition in force lasts, and of several stragglers, latencies, bandwidth caps,
drops or corruptions in force the strongest holds (the largest factor, latency or probability, the
smallest bandwidth), each until its own `until`.

Each parameter is bounded (`value_bounds`), here and in a chaos plan alike: the processes that obey it
wait for what it asks (a step `factor` times as long, a message held for the latency or for its bytes over
the bandwidth), so a value such as 1e300 would have them wait for ever or overflow the wait. The plan
bounds latency and bandwidth by its own duration; this file, which may be written by hand and carries no
run length, by the longest run, MAX_RUN_S. An entry out of bounds makes the file unreadable: "no faults",
with a warning naming the file, the field and the bound.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checks import invalid

logger = logging.getLogger(__name__)

CONTROL_FILE = "chaos.json"
"""Name of a target's control file inside its own directory (`learners/N/`, `ranks/R/`)."""
IN_PROCESS_KINDS = ("partition", "latency", "bandwidth", "drop", "corrupt", "straggler")
"""Faults carried out by the target process itself, through its control file."""
PARAMS = {"latency": "latency_s", "bandwidth": "bytes_per_s", "drop": "probability", "corrupt": "probability",
          "straggler": "factor"}
"""The one parameter each kind carries in the control file (partition carries none)."""
DEFAULT_REFRESH_S = 0.1


@dataclass(frozen=True)
class ActiveFault:
    """One fault switched on in a process until wall time `until`."""

    kind: str
    until: float
    value: float | None = None
    """latency_s, bytes_per_s, probability or factor, by kind (see PARAMS)."""

    def __post_init__(self) -> None:
        if self.kind not in IN_PROCESS_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not carried out in-process: expected one of "
                             f"{', '.join(IN_PROCESS_KINDS)}")
        if not math.isfinite(self.until):
            raise invalid("until", self.until, "a finite wall time")
        if self.kind in PARAMS and not value_valid(self.kind, self.value):
            raise ValueError(f"{self.kind} fault with {PARAMS[self.kind]}={self.value!r} is invalid: expected "
                             f"{value_expected(self.kind)}")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, "until": self.until}
        if self.kind in PARAMS:
            data[PARAMS[self.kind]] = self.value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ActiveFault:
        kind = data.get("kind")
        param = PARAMS.get(kind) if isinstance(kind, str) else None
        return cls(str(kind), float(data["until"]), None if param is None else float(data[param]))


MAX_RUN_S = 7 * 24 * 3600.0
"""The longest chaos run, seconds (a week): far beyond any soak or benchmark here (minutes), and short enough that a
typo such as 1e30 is refused instead of starting a run that never ends by itself. It bounds a plan's duration,
each fault's duration, and the latency and bandwidth of a control file, which knows no run length."""
MAX_SLOWDOWN = 100.0
"""A straggler's largest factor: 100 x turns a 0.2 s inner step into 20 s; a learner slower than that contributes
nothing a run of minutes could measure: it is a `hang`."""
REFERENCE_MESSAGE_BYTES = 1e6
"""The message a bandwidth cap must let through within the run (1 MB: the order of one update of the default
478,720-parameter TinyGPT, 1.9 MB in fp32): a slower cap holds the link past the run's end, a partition."""


def value_bounds(kind: str, run_s: float = MAX_RUN_S) -> tuple[float, float]:
    """[low, high] of the parameter of a fault of `kind` in a run of `run_s` seconds, both inclusive: a
    latency at most the run, a bandwidth that sends REFERENCE_MESSAGE_BYTES within it, a factor up to
    MAX_SLOWDOWN, a probability in [0, 1]."""
    if kind in ("drop", "corrupt"):
        return 0.0, 1.0
    if kind == "straggler":
        return 1.0, MAX_SLOWDOWN
    if kind == "latency":
        return 0.0, run_s
    if kind == "bandwidth":
        return REFERENCE_MESSAGE_BYTES / run_s, math.inf
    raise ValueError(f"kind {kind!r} takes no parameter: expected one of {', '.join(PARAMS)}")


def value_expected(kind: str, run_s: float = MAX_RUN_S, *, run: str = "") -> str:
    """What the parameter of a fault of `kind` must be, in words (`run` says where `run_s` came from)."""
    low, high = value_bounds(kind, run_s)
    run = run or ("the longest run (a week)" if run_s == MAX_RUN_S else f"a run of {run_s:g} s")
    if kind == "straggler":
        return f"a slowdown factor in [1, {high:g}] (slower than {high:g} x is a hang: use kind hang)"
    if kind == "latency":
        return f"seconds in [0, {high:g}], at most {run}"
    if kind == "bandwidth":
        return (f"bytes per second >= {low:g}, to send a {REFERENCE_MESSAGE_BYTES / 1e6:g} MB message within {run} "
                "(a slower link is a partition: use kind partition)")
    return "a probability in [0, 1]"


def value_valid(kind: str, value: float | None, run_s: float = MAX_RUN_S) -> bool:
    """Whether `value` is a valid parameter for a fault of `kind` in a run of `run_s` seconds (`value_bounds`)."""
    if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
        return False
    low, high = value_bounds(kind, run_s)
    return low <= value <= high


WEAKER_IS_LARGER = ("bandwidth",)
"""Kinds whose parameter hurts more the smaller it is (a tighter cap); for the others a larger one is stronger."""


def strongest(faults: Iterable[ActiveFault]) -> dict[str, ActiveFault]:
    """kind -> the strongest of `faults` of that kind (see the module docstring); of equals, the one that lasts
    longest, so that a partition holds for the union of the partitions given."""
    best: dict[str, ActiveFault] = {}
    for fault in faults:
        current = best.get(fault.kind)
        if current is None or _strength(fault) > _strength(current):
            best[fault.kind] = fault
    return best


def _strength(fault: ActiveFault) -> tuple[float, float]:
    value = 0.0 if fault.value is None else fault.value
    return (-value if fault.kind in WEAKER_IS_LARGER else value, fault.until)


def write_control(path: str | Path, faults: Iterable[ActiveFault]) -> None:
    """Replace a target's control file atomically (temp file + rename: readers never see half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"faults": [f.to_json() for f in faults]}, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class ChaosControl:
    """A process's view of its control file. Thread-safe; cheap to query on every message."""

    path: Path
    clock: Callable[[], float] = time.time
    refresh_s: float = DEFAULT_REFRESH_S
    seed: int | None = None
    """Seed of the draws for drop and corrupt (None: from the OS)."""
    _faults: list[ActiveFault] = field(default_factory=list, init=False)
    _checked_at: float = field(default=-math.inf, init=False)
    _stamp: tuple[int, int] | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.rng = random.Random(self.seed)

    def active(self) -> dict[str, ActiveFault]:
        """kind -> the fault of that kind in force now (the strongest, where several overlap: `strongest`)."""
        now = self.clock()
        with self._lock:
            if now - self._checked_at >= self.refresh_s:
                self._checked_at = now
                self._reload()
            return strongest(f for f in self._faults if f.until > now)

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._faults, self._stamp = [], None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        try:
            entries = json.loads(self.path.read_text(encoding="utf-8")).get("faults", [])
            faults = [ActiveFault.from_json(entry) for entry in entries]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("chaos control file %s unreadable (%s): no faults", self.path, exc)
            faults = []
        self._stamp = stamp
        self._faults = faults

    def _value(self, kind: str, default: float) -> float:
        fault = self.active().get(kind)
        return default if fault is None or fault.value is None else fault.value

    def partitioned(self) -> bool:
        return "partition" in self.active()

    def extra_latency_s(self) -> float:
        return self._value("latency", 0.0)

    def bandwidth_bytes_per_s(self) -> float | None:
        fault = self.active().get("bandwidth")
        return None if fault is None else fault.value

    def slowdown(self) -> float:
        return self._value("straggler", 1.0)

    def should_drop(self) -> bool:
        """A draw: is this message lost? (False whenever no drop fault is active.)"""
        p = self._value("drop", 0.0)
        return p > 0.0 and self.rng.random() < p

    def should_corrupt(self) -> bool:
        """A draw: is this message corrupted in flight?"""
        p = self._value("corrupt", 0.0)
        return p > 0.0 and self.rng.random() < p


def control_path(target_dir: str | Path) -> Path:
    return Path(target_dir) / CONTROL_FILE
