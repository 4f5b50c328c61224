"""The one definition of goodput, uptime, merged work and recovery time, over one event-log schema.

Every producer of a run's record turns it into an `EventLog`: the virtual-time harness
(`ddiloco.sim`) builds one as it runs, the chaos analysis (`ddiloco.chaos.analysis`) converts the
files of a real run into one. The metrics below are computed here and nowhere else, so a simulated
run and a real one, or two systems of one experiment, are measured by the same rules. Plain data and
the standard library only: this module sits below every driver.

The schema (`EventLog`):

- **window** [start_s, end_s): from the start of the first inner step of any learner (set-up is not
  training) to the end of the measured run (the harness: the end of the last inner step; a chaos run:
  the stop request). T = end_s - start_s; **allocated** learner-seconds = num_learners x T.
- **work** (`Work`: learner, category, seconds): where each learner's computed inner-step time ended.
  Useful categories (`USEFUL_CATEGORIES`): `merged` (it reached the global model through a committed
  round, or, data-parallel, a step that stays in the model), `overwritten` (a newer version of the
  fragment arrived before the learner published it: it still steered the learner's other fragments,
  and the paper's goodput at K = 1 counts it), `unfinished` (still unpublished when the run ended: an
  artefact of a finite run, not a cost of the system), and `kept` (useful work that the producer
  cannot split into those three: the chaos analysis of a real run books computed minus lost there).
  Lost categories (`LOST_CATEGORIES`): `crashed` (the learner failed before publishing, its update was
  lost in flight, or, in a real run, the next incarnation trains it again), `rejected` (the syncer
  refused the update), `dropped` (a real run's update that never arrived), `resync` (what a re-join's
  Welcome replaced), `unmerged` (accepted, but in no committed round), `rolled_back` (undone by a
  restart from a checkpoint).
- **advances** (`Advance`: time_s, learners, tokens): the global model advanced: a round committed
  (learners: its participants), or, data-parallel, a step above every earlier step number (a step done
  again after a rollback is not progress).
- **faults** (`FaultSpan`: target, start_s, end_s, kind, back_s): a failure and its recovery; target is a
  learner (or rank) index, or None for the syncer.

The definitions:

- **goodput** = useful work / allocated learner-seconds.
- **merged work fraction** = merged work / allocated learner-seconds (the strict share).
- **uptime** = share of the window in which the global model advances, measured in bins: the window is
  cut into bins of `uptime_bin_s` from its start; a bin holding at least one advance (start_s <= t <=
  end_s) is up; the last, partial bin counts by its length. The bin is the producer's resolution: the
  harness uses one sync period (H nominal inner steps: each fragment commits once per period in steady
  state, so a healthy run is up in every bin), a chaos run `--uptime-bin-s` of wall time (default 5 s).
- **stall** of a fault: from its start to the first advance after it (None if none by the window's
  end): how long the global model stood still. An advance at the fault's very instant is pre-fault
  progress; since advances are progress beyond every earlier state, the first one after the start is
  the first beyond the pre-fault progress.
- **rejoin** of a fault: from its end to when its target contributes again: `back_s` where the producer
  observed it (a data-parallel rank's first step), else the first advance at or after the end that
  merges the target (the syncer: any advance); None if that did not happen within the window.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checks import invalid, require, require_choice, require_int, require_positive

USEFUL_CATEGORIES = ("merged", "overwritten", "unfinished", "kept")
LOST_CATEGORIES = ("crashed", "rejected", "dropped", "resync", "unmerged", "rolled_back")
WORK_CATEGORIES = USEFUL_CATEGORIES + LOST_CATEGORIES


@dataclass(frozen=True)
class Work:
    """`seconds` of learner `learner`'s computed inner-step time ended in `category`."""

    learner: int
    category: str
    seconds: float

    def __post_init__(self) -> None:
        require_choice("category", self.category, WORK_CATEGORIES)


@dataclass(frozen=True)
class Advance:
    """The global model advanced at `time_s` (a committed round, or a new data-parallel step)."""

    time_s: float
    learners: tuple[int, ...] = ()
    """Who the advance merged (a round's participants; data-parallel: the replicas of the step)."""
    tokens: float = 0.0
    """Tokens the advance added to the global model."""


@dataclass(frozen=True)
class FaultSpan:
    """A failure on [start_s, end_s) of `target` (a learner or rank index; None: the syncer)."""

    target: int | None
    start_s: float
    end_s: float
    kind: str = "crash"
    back_s: float | None = None
    """When the target contributed again, where the producer observed it (math.inf: it did not); None: from
    the advances."""


@dataclass(frozen=True)
class EventLog:
    """One system's run, as every metric here reads it (the schema is the module docstring)."""

    num_learners: int
    start_s: float
    end_s: float
    uptime_bin_s: float
    work: tuple[Work, ...] = ()
    advances: tuple[Advance, ...] = ()
    faults: tuple[FaultSpan, ...] = ()
    categories: tuple[str, ...] = WORK_CATEGORIES
    """The work categories the producer books, in the order its breakdown lists them."""

    def __post_init__(self) -> None:
        require_int("num_learners", self.num_learners, minimum=1)
        require(math.isfinite(self.start_s) and math.isfinite(self.end_s) and self.end_s >= self.start_s,
                "end_s", self.end_s, f"a finite time >= start_s={self.start_s!r}")
        require_positive("uptime_bin_s", self.uptime_bin_s, "seconds")
        for category in self.categories:
            require_choice("categories", category, WORK_CATEGORIES)
        object.__setattr__(self, "work", tuple(self.work))
        object.__setattr__(self, "advances", tuple(sorted(self.advances, key=lambda a: a.time_s)))
        object.__setattr__(self, "faults", tuple(self.faults))

    @property
    def window_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def allocated_s(self) -> float:
        return self.num_learners * self.window_s

    # ---- JSONL: one record per line, {"record": "window" | "work" | "advance" | "fault", ...} ----

    def to_records(self) -> list[dict[str, Any]]:
        window = {"record": "window", "num_learners": self.num_learners, "start_s": self.start_s,
                  "end_s": self.end_s, "uptime_bin_s": self.uptime_bin_s, "categories": list(self.categories)}
        return [window, *({"record": "work", **asdict(w)} for w in self.work),
                *({"record": "advance", **asdict(a), "learners": list(a.learners)} for a in self.advances),
                *({"record": "fault", **asdict(f)} for f in self.faults)]

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]]) -> EventLog:
        window: dict[str, Any] | None = None
        work, advances, faults = [], [], []
        for record in records:
            fields = {k: v for k, v in record.items() if k != "record"}
            kind = record.get("record")
            if kind == "window":
                window = fields
            elif kind == "work":
                work.append(Work(**fields))
            elif kind == "advance":
                advances.append(Advance(**{**fields, "learners": tuple(fields.get("learners", ()))}))
            elif kind == "fault":
                faults.append(FaultSpan(**fields))
            else:
                raise invalid("record", kind, "one of window, work, advance, fault")
        if window is None:
            raise ValueError("the event log has no window record: expected one line {\"record\": \"window\", ...}")
        return cls(**{**window, "categories": tuple(window.get("categories", WORK_CATEGORIES))},
                   work=tuple(work), advances=tuple(advances), faults=tuple(faults))

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in self.to_records()), encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: str | Path) -> EventLog:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        return cls.from_records(json.loads(line) for line in lines if line.strip())


# ---- the definitions ---------------------------------------------------------------------------------

def work_total(log: EventLog, category: str) -> float:
    """Learner-seconds booked in `category`, summed in the log's order."""
    return sum(w.seconds for w in log.work if w.category == category)


def useful_s(log: EventLog) -> float:
    return sum(work_total(log, c) for c in USEFUL_CATEGORIES)


def lost_s(log: EventLog) -> float:
    return sum(work_total(log, c) for c in LOST_CATEGORIES)


def goodput(log: EventLog) -> float:
    allocated = log.allocated_s
    return useful_s(log) / allocated if allocated > 0 else 0.0


def merged_work_fraction(log: EventLog) -> float:
    allocated = log.allocated_s
    return work_total(log, "merged") / allocated if allocated > 0 else 0.0


def work_breakdown(log: EventLog) -> dict[str, float]:
    """Share of allocated learner-seconds per category the producer books."""
    allocated = log.allocated_s
    if allocated <= 0:
        return dict.fromkeys(log.categories, 0.0)
    return {c: work_total(log, c) / allocated for c in log.categories}


def binned_uptime(times: Iterable[float], start: float, end: float, bin_s: float) -> float:
    """Share of [start, end) covered by `bin_s` bins from `start` that hold at least one of `times`
    (start <= t <= end); the last, partial bin counts by its length."""
    if end <= start:
        return 0.0
    covered = 0.0
    bins = {int((t - start) // bin_s) for t in times if start <= t <= end}
    for index in bins:
        low = start + index * bin_s
        covered += max(0.0, min(low + bin_s, end) - low)
    return min(1.0, covered / (end - start))


def uptime(log: EventLog) -> float:
    return binned_uptime((a.time_s for a in log.advances), log.start_s, log.end_s, log.uptime_bin_s)


def _first_at_or_after(times: Iterable[float], after: float, end: float) -> float | None:
    return min((t for t in times if after <= t <= end), default=None)


def stall_s(log: EventLog, fault: FaultSpan) -> float | None:
    """From the fault's start to the next advance of the global model (None: not within the window)."""
    next_advance = min((a.time_s for a in log.advances if fault.start_s < a.time_s <= log.end_s), default=None)
    return None if next_advance is None else next_advance - fault.start_s


def rejoin_s(log: EventLog, fault: FaultSpan) -> float | None:
    """From the fault's end to when its target contributes again (None: not within the window)."""
    if fault.back_s is not None:
        return fault.back_s - fault.end_s if fault.back_s <= log.end_s else None
    times = (a.time_s for a in log.advances if fault.target is None or fault.target in a.learners)
    back = _first_at_or_after(times, fault.end_s, log.end_s)
    return None if back is None else back - fault.end_s


@dataclass(frozen=True)
class Summary:
    """Every definition of the module for one log."""

    goodput: float
    merged_work_fraction: float
    uptime: float
    useful_s: float
    allocated_s: float
    work_breakdown: dict[str, float] = field(default_factory=dict)
    recoveries: tuple[tuple[float | None, float | None], ...] = ()
    """Per fault, in the log's order: (stall_s, rejoin_s)."""


def summarize(log: EventLog) -> Summary:
    return Summary(goodput=goodput(log), merged_work_fraction=merged_work_fraction(log), uptime=uptime(log),
                   useful_s=useful_s(log), allocated_s=log.allocated_s, work_breakdown=work_breakdown(log),
                   recoveries=tuple((stall_s(log, f), rejoin_s(log, f)) for f in log.faults))


def booked_work(seconds: Sequence[dict[str, float]]) -> tuple[Work, ...]:
    """`Work` records of per-learner {category: seconds}, learner by learner."""
    return tuple(Work(learner, category, value)
                 for learner, per in enumerate(seconds) for category, value in per.items())
