"""What a chaos run cost each system: goodput, uptime, recovery times, loss vs wall time, bytes.

Reads one system directory of a chaos run (DIR/decoupled, DIR/sync_diloco: a `ddiloco run` directory
with the learners' work ledgers; DIR/data_parallel; each with the runner's `chaos/run.json` and
`chaos/faults.jsonl`), converts it into the `ddiloco.goodput` event log (`runtime_event_log`,
`data_parallel_event_log`) and returns plain data; plotting is `ddiloco.chaos.report`'s. Goodput, uptime
and the recovery times are `ddiloco.goodput`'s definitions, the same the virtual-time harness uses, so a
real run and a simulated one compare. What this module decides is how a real run's files map onto the
schema:

- **window**: from the start of the first inner step of any learner (data-parallel: any rank) to
  the stop request (`run.json` "stop_requested": the end of the plan's duration); start-up is set-up
  and shutting down is tear-down.
- **nominal step time**: the median interval between consecutive inner steps (step n, then n + 1) of
  a learner (data-parallel: of rank 0): a step at its normal pace, loop overhead included, the same
  measure for every system. Slowed, waiting or hung steps count only this much. Work is booked in
  step-equivalents x the **booked step time**: the nominal one, but at most the window / the steps in it,
  so a learner's steps never add up to more than the window they lie in (in a run of a few seconds a
  median gap can exceed most of the gaps: six steps of gaps 0.3, 0.3, 0.3, 0.1, 0.1 in a 1.4 s window
  would book 1.8 s) and no share exceeds 1.
- **Decoupled / synchronous DiLoCo**, per learner:
  computed = inner steps logged in the window; lost step-equivalents (each fragment weighted by its
  share of the parameters): `rejected` (new steps of publishes refused by the syncer), `dropped`
  (publishes that never arrived), `crashed` (an incarnation killed hard: the inner steps the next
  incarnation trains again after resuming from its checkpoint, once, plus each fragment's work not yet
  published before that resume point, and its publishes without a fate), `resync` (what a
  re-join's Welcome replaced, from non-first welcomes) and `unmerged` (accepted, but in no committed
  round, neither as a participant nor folded into one: the syncer died or stopped with the round open).
  The rest, computed - lost, is booked as `kept`: work merged, overwritten by a newer version or unfinished at
  the end, which the files do not tell apart and which all count as useful. `work_s` holds every category in
  learner-seconds.
  The global model advances with every committed round in the window.
- **data-parallel**: rank 0's steps in the window, kept or rolled back by
  `ddiloco.data_parallel.account_steps` (the steps of attempt a are kept up to the `from_step` of attempt
  a + 1, all of the last attempt's); every rank books kept x nominal as `merged` and the rest as
  `rolled_back`. The global model advances with every step of rank 0 above every earlier step number.
- **uptime bin**: `uptime_bin_s` of wall time (`--uptime-bin-s`, default 5 s).
- per fault, its span from the runner's record, its end at most the window's end (the runner records
  when a fault was lifted, or the stop; older records gave the planned end); a fault the run did not
  reach (no start) is not one. **stall_s** and **rejoin_s** as `ddiloco.goodput` defines them; a learner
  contributes again with the first commit after the fault's end that merges it, the syncer with the next commit, a
  data-parallel rank with its first step after the end (in the next attempt if one started before that
  step).
- **rounds_per_min**: commits per minute (data-parallel: kept steps per minute, `progress_unit` says
  which); **bytes**: syncer payload bytes sent + received (data-parallel: all-reduce bytes computed
  from the model size, `bytes_label` says which).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import read_json, read_jsonl
from ddiloco.data_parallel import account_steps
from ddiloco.goodput import Advance, EventLog, FaultSpan, Work, goodput, rejoin_s, stall_s, uptime

SYSTEMS = ("decoupled", "sync_diloco", "data_parallel")
"""The system directories of a chaos run, in report order."""
DATA_PARALLEL = "data_parallel"
DEFAULT_UPTIME_BIN_S = 5.0
"""Coarse enough that a healthy system commits in every bin (rounds come every second or so), fine
enough that a 10 s outage shows."""
LOST_CATEGORIES = ("rejected", "dropped", "crashed", "resync", "unmerged")
"""The `ddiloco.goodput` lost categories a DiLoCo run's files show."""
RUNTIME_CATEGORIES = ("kept", *LOST_CATEGORIES)
DATA_PARALLEL_CATEGORIES = ("merged", "rolled_back")
_TARGET = re.compile(r"^(?:learner|rank)-([0-9]+)$")


def run_info(system_dir: Path) -> dict[str, Any]:
    info = read_json(system_dir / "chaos" / "run.json")
    if not isinstance(info, dict):
        raise ValueError(f"{system_dir / 'chaos' / 'run.json'} is missing or unreadable: expected the chaos "
                         "runner's record of the system's launch and stop")
    return info


def target_index(target: str | None) -> int | None:
    """`learner-1` / `rank-1` -> 1; `syncer` -> None."""
    match = _TARGET.match(target or "")
    return int(match.group(1)) if match else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def booked_step_s(nominal_s: float, steps: int, window_s: float) -> float:
    """The time one step in the window is booked at: the nominal step time, but at most window / steps, so a
    learner's (rank's) steps never add up to more than the window (see the module docstring)."""
    return min(nominal_s, window_s / steps) if steps > 0 else nominal_s


def _faults(system_dir: Path, end: float, back=None) -> tuple[list[dict[str, Any]], list[FaultSpan]]:
    """The injector's log of the faults it executed and those faults in the `ddiloco.goodput` schema, each ended
    at most at the window's `end`; `back(fault, started, ended)` gives the time the target contributed again
    where the schema's rule from the advances does not apply."""
    records = [r for r in read_jsonl(system_dir / "chaos" / "faults.jsonl") if r.get("started") is not None]
    faults = []
    for fault in records:
        started = float(fault["started"])
        ended = max(started, min(float(fault.get("ended") if fault.get("ended") is not None else started), end))
        observed = None if back is None else back(fault, started, ended)
        faults.append(FaultSpan(target_index(fault.get("target")), started, ended, str(fault.get("kind")),
                            None if back is None else (math.inf if observed is None else observed)))
    return records, faults


def log_results(log: EventLog, fault_records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Goodput, uptime and the per-fault recovery rows of an event log, by `ddiloco.goodput`'s definitions
    (times relative to the window's start)."""
    records = fault_records if fault_records is not None else [{} for _ in log.faults]
    rows = []
    for record, fault in zip(records, log.faults, strict=True):
        rows.append({"index": record.get("index"), "kind": record.get("kind", fault.kind),
                     "target": record.get("target", fault.target), "start_s": fault.start_s - log.start_s,
                     "end_s": fault.end_s - log.start_s, "duration_s": fault.end_s - fault.start_s,
                     "stall_s": stall_s(log, fault), "rejoin_s": rejoin_s(log, fault)})
    return {"goodput": goodput(log), "uptime": uptime(log), "uptime_bin_s": log.uptime_bin_s,
            "allocated_learner_s": log.allocated_s, "window_s": log.window_s, "window_start": log.start_s,
            "faults": rows, "faults_injected": len(rows)}


def _step_gaps(steps: list[dict[str, Any]]) -> list[float]:
    """Wall seconds between consecutive steps (step n, then n + 1): a step at its normal pace, with its
    share of the loop's own work (logging, publishing), which a step's compute time alone leaves out."""
    return [float(b["time"]) - float(a["time"]) for a, b in zip(steps, steps[1:], strict=False)
            if int(b["step"]) == int(a["step"]) + 1 and float(b["time"]) > float(a["time"])]


def _per_minute(count: int, window_s: float) -> float:
    return count / (window_s / 60.0) if window_s > 0 else 0.0


# ---- Decoupled and synchronous DiLoCo -----------------------------------------------------------------

class _LearnerLog:
    """One learner's inner steps (metrics.jsonl) and work ledger (work.jsonl), cut into incarnations."""

    def __init__(self, learner_dir: Path, learner_id: int) -> None:
        loss_key, self.step_s_key = f"learner/{learner_id}/loss", f"learner/{learner_id}/step_s"
        self.steps = [m for m in read_jsonl(learner_dir / "metrics.jsonl") if loss_key in m and "step" in m]
        self.incarnations: list[list[dict[str, Any]]] = []
        for event in read_jsonl(learner_dir / "work.jsonl"):
            if event.get("event") == "start" or not self.incarnations:
                self.incarnations.append([])
            self.incarnations[-1].append(event)

    def first_step_start(self) -> float | None:
        if not self.steps:
            return None
        first = self.steps[0]
        return float(first["time"]) - float(first.get(self.step_s_key) or 0.0)

    def nominal_step_s(self) -> float:
        gaps = _step_gaps(self.steps)
        if gaps:
            return _median(gaps)
        return _median([float(m[self.step_s_key]) for m in self.steps if m.get(self.step_s_key) is not None])

    def last_inner_step(self, index: int) -> int:
        """The last inner step of incarnation `index`: its last metric line before the next start."""
        events = self.incarnations[index]
        begin = float(events[0].get("time", -math.inf))
        stop = float(self.incarnations[index + 1][0].get("time", math.inf)) \
            if index + 1 < len(self.incarnations) else math.inf
        steps = [int(m["step"]) for m in self.steps if begin <= float(m["time"]) < stop]
        steps += [int(e["inner_step"]) for e in events if e.get("inner_step") is not None]
        return max(steps, default=0)


def _learner_losses(log: _LearnerLog, merged: set[tuple[int, int, int]], learner_id: int) -> dict[str, float]:
    """Lost step-equivalents of one learner, by category (see the module docstring)."""
    lost = dict.fromkeys(LOST_CATEGORIES, 0.0)
    for index, events in enumerate(log.incarnations):
        start = events[0]
        shares = [float(s) for s in start.get("shares") or [1.0]]
        synced = [int(start.get("inner_step", 0))] * len(shares)
        pending: dict[tuple[int, int, int], dict[str, Any]] = {}
        welcomes = 0
        ended = False
        for event in events:
            kind = event.get("event")
            fragment = int(event.get("fragment", 0))
            key = (fragment, int(event.get("base_version", -1)), int(event.get("inner_step", -1)))
            if kind == "welcome":
                if welcomes:
                    lost["resync"] += sum(u * s for u, s in zip(event.get("unpublished", []), shares, strict=False))
                welcomes += 1
                # A fragment the Welcome kept (still at the learner's version) reports 0 and keeps its point.
                unpublished = event.get("unpublished") or [1] * len(shares)
                synced = [int(event["inner_step"]) if u else s for s, u in zip(synced, unpublished, strict=False)]
            elif kind == "position":  # synchronous DiLoCo: the inner-step count jumped to the global phase
                synced = [int(event["inner_step"])] * len(shares)
            elif kind == "publish":
                pending[key] = event
                synced[fragment] = int(event["inner_step"])
            elif kind == "received":
                synced[fragment] = int(event["inner_step"])
            elif kind == "fate":
                publish = pending.pop(key, None)
                steps = float(publish.get("new_steps", 0)) * shares[fragment] if publish else 0.0
                if event.get("fate") in ("rejected", "dropped"):
                    lost[event["fate"]] += steps
                elif (learner_id, fragment, key[2]) not in merged:
                    lost["unmerged"] += steps
            elif kind == "end":
                ended = True
        resume = math.inf
        if not ended:
            last = log.last_inner_step(index)
            # The next incarnation resumes from its checkpoint at `resume` and trains (resume, last] again:
            # that range counts once as lost (its first pass was thrown away, or, where it was merged,
            # its second pass repeats it), plus each fragment's unpublished work before the resume point.
            resume = last
            if index + 1 < len(log.incarnations):
                resume = min(last, int(log.incarnations[index + 1][0].get("inner_step", last)))
            lost["crashed"] += (last - resume) + sum(max(0, resume - s) * share
                                                     for s, share in zip(synced, shares, strict=True))
        # A publish with no fate never reached a verdict: its work went down with the process (the part
        # of it after the resume point is already counted above).
        for p in pending.values():
            step, new_steps = int(p.get("inner_step", 0)), float(p.get("new_steps", 0))
            lost["crashed"] += max(0.0, min(step, resume) - (step - new_steps)) * shares[int(p.get("fragment", 0))]
    return lost


def window_end(info: dict[str, Any]) -> float:
    """The end of the measured window: the stop request (records written before it existed: the end)."""
    return float(info.get("stop_requested", info["ended"]))


def _runtime(system_dir: Path, uptime_bin_s: float) -> tuple[EventLog, list[dict[str, Any]], dict[str, Any]]:
    """A Decoupled or synchronous DiLoCo directory as an event log, its fault records, and what only the
    report needs (work in learner-seconds, per-learner detail, loss, rounds, bytes, restarts)."""
    info = run_info(system_dir)
    num_learners = int(info["num_learners"])
    logs = [_LearnerLog(system_dir / "learners" / str(i), i) for i in range(num_learners)]
    end = window_end(info)
    start = min((t for log in logs if (t := log.first_step_start()) is not None), default=float(info["started"]))
    end = max(start, end)

    rounds = read_jsonl(system_dir / "rounds.jsonl")
    # A participant names its update, and the learner's earlier ones it includes (`Participant.folded`: a late
    # update held and merged with the next, or replaced by the same work continued): all of them were merged.
    merged = {(int(p["learner_id"]), int(r["fragment"]), int(inner_step))
              for r in rounds for p in r.get("participants", [])
              for inner_step in (p.get("inner_step", -1), *(step for _, step in p.get("folded", [])))}
    work_s = dict.fromkeys(("computed", *LOST_CATEGORIES, "useful"), 0.0)
    work: list[Work] = []
    per_learner = {}
    for learner_id, log in enumerate(logs):
        computed = sum(1 for m in log.steps if start <= float(m["time"]) <= end)
        measured = log.nominal_step_s()
        nominal = booked_step_s(measured, computed, end - start)
        lost = _learner_losses(log, merged, learner_id)
        useful_steps = max(0.0, computed - sum(lost.values()))
        per_learner[learner_id] = {"nominal_step_s": measured, "booked_step_s": nominal,
                                   "computed_steps": computed,
                                   "lost_steps": lost, "useful_s": useful_steps * nominal,
                                   "incarnations": len(log.incarnations)}
        work.append(Work(learner_id, "kept", useful_steps * nominal))
        work += [Work(learner_id, category, steps * nominal) for category, steps in lost.items()]
        work_s["computed"] += computed * nominal
        for category, steps in lost.items():
            work_s[category] += steps * nominal
        work_s["useful"] += useful_steps * nominal

    syncer_events = read_jsonl(system_dir / "syncer" / "metrics.jsonl")
    commits = sorted((e for e in syncer_events if e.get("event") == "commit"), key=lambda e: float(e["time"]))
    advances = [Advance(float(e["time"]), tuple(int(i) for i in e.get("learners", [])))
                for e in commits if start <= float(e["time"]) <= end]
    fault_records, faults = _faults(system_dir, end)
    events = EventLog(num_learners=num_learners, start_s=start, end_s=end, uptime_bin_s=uptime_bin_s,
                      work=tuple(work), advances=tuple(advances), faults=tuple(faults),
                      categories=RUNTIME_CATEGORIES)

    syncer_starts = sum(1 for e in syncer_events if e.get("event") == "start")
    learner_restarts = sum(max(0, len(log.incarnations) - 1) for log in logs)
    val_loss = [[float(m["time"]) - start, float(m["eval/val_loss"])]
                for m in read_jsonl(system_dir / "evaluator" / "metrics.jsonl") if m.get("eval/val_loss") is not None]
    status = read_json(system_dir / "syncer_status.json") or {}
    extra = {
        "system": info.get("system", system_dir.name), "num_learners": num_learners,
        "work_s": work_s, "useful_learner_s": work_s["useful"], "per_learner": per_learner,
        "val_loss": val_loss, "final_val_loss": val_loss[-1][1] if val_loss else None,
        "rounds_per_min": _per_minute(len(advances), events.window_s), "progress_unit": "rounds",
        "progress": [[a.time_s - start, i + 1] for i, a in enumerate(advances)],
        "bytes": int(status.get("bytes_sent", 0)) + int(status.get("bytes_received", 0)),
        "bytes_label": "syncer payload bytes sent + received",
        "restarts": learner_restarts + max(0, syncer_starts - 1),
        "restart_detail": {"learners": learner_restarts, "syncer": max(0, syncer_starts - 1)},
    }
    return events, fault_records, extra


def runtime_event_log(system_dir: str | Path, *, uptime_bin_s: float = DEFAULT_UPTIME_BIN_S) -> EventLog:
    """A Decoupled or synchronous DiLoCo system directory in the `ddiloco.goodput` schema."""
    return _runtime(Path(system_dir), uptime_bin_s)[0]


def analyze_runtime(system_dir: str | Path, *, uptime_bin_s: float = DEFAULT_UPTIME_BIN_S) -> dict[str, Any]:
    """Results of a Decoupled or synchronous DiLoCo system directory (definitions in the module docstring)."""
    events, fault_records, extra = _runtime(Path(system_dir), uptime_bin_s)
    return _results(events, fault_records, extra)


def _results(events: EventLog, fault_records: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    results = log_results(events, fault_records)
    return {"system": extra.pop("system"), "num_learners": extra.pop("num_learners"), **results, **extra}


# ---- data-parallel ------------------------------------------------------------------------------------

def _rank_steps(system_dir: Path, rank: int) -> list[dict[str, Any]]:
    key = f"dp/{rank}/step_s"
    lines = [m for m in read_jsonl(system_dir / "ranks" / str(rank) / "metrics.jsonl") if key in m]
    return sorted(lines, key=lambda m: float(m["time"]))


def _data_parallel(system_dir: Path, uptime_bin_s: float) -> tuple[EventLog, list[dict[str, Any]], dict[str, Any]]:
    """The data-parallel directory as an event log, its fault records, and what only the report needs."""
    info = run_info(system_dir)
    num_ranks = int(info["num_learners"])
    ranks = {r: _rank_steps(system_dir, r) for r in range(num_ranks)}
    rank0 = ranks[0]
    end = window_end(info)
    starts = [float(lines[0]["time"]) - float(lines[0][f"dp/{r}/step_s"]) for r, lines in ranks.items() if lines]
    start = min(starts, default=float(info["started"]))
    end = max(start, end)
    measured = _median(_step_gaps(rank0)) if len(rank0) > 1 else _median([float(m["dp/0/step_s"]) for m in rank0])

    events = read_jsonl(system_dir / "metrics.jsonl")
    attempt_starts = sorted((e for e in events if e.get("event") == "attempt_start"), key=lambda e: int(e["attempt"]))
    in_window = [m for m in rank0 if start <= float(m["time"]) <= end]
    nominal = booked_step_s(measured, len(in_window), end - start)
    kept = account_steps([(int(m.get("attempt", 0)), int(m["step"])) for m in in_window],
                         {int(a["attempt"]): int(a["from_step"]) for a in attempt_starts}).kept
    advances, high = [], -math.inf
    for m in in_window:
        if int(m["step"]) > high:
            high = int(m["step"])
            advances.append(Advance(float(m["time"]), tuple(range(num_ranks))))
    work = [Work(rank, category, steps * nominal) for rank in range(num_ranks)
            for category, steps in (("merged", kept), ("rolled_back", len(in_window) - kept))]

    def back(fault: dict[str, Any], started: float, ended: float) -> float | None:
        """A rank contributes again with its first step after the fault's end, in the next attempt if the
        fault ended the one it hit."""
        rank = target_index(fault.get("target"))
        lines = ranks.get(rank, rank0) if rank is not None else rank0
        step = next((m for m in lines if float(m["time"]) >= ended), None)
        restarted = next((a for a in attempt_starts if float(a["time"]) >= started), None)
        if restarted is not None and (step is None or float(restarted["time"]) <= float(step["time"])):
            step = next((m for m in lines if float(m["time"]) >= ended
                         and int(m.get("attempt", 0)) >= int(restarted["attempt"])), None)
        return None if step is None else float(step["time"])

    fault_records, faults = _faults(system_dir, end, back)
    log = EventLog(num_learners=num_ranks, start_s=start, end_s=end, uptime_bin_s=uptime_bin_s, work=tuple(work),
                   advances=tuple(advances), faults=tuple(faults), categories=DATA_PARALLEL_CATEGORIES)

    useful = num_ranks * kept * nominal
    val_loss = [[float(m["time"]) - start, float(m["dp/val_loss"])]
                for m in read_jsonl(system_dir / "ranks" / "0" / "metrics.jsonl") if m.get("dp/val_loss") is not None]
    summary = read_json(system_dir / "summary.json") or {}
    attempts = int(summary.get("attempts", len(attempt_starts)) or 0)
    extra = {
        "system": info.get("system", DATA_PARALLEL), "num_learners": num_ranks,
        "work_s": {"computed": num_ranks * len(in_window) * nominal,
                   "rolled_back": num_ranks * (len(in_window) - kept) * nominal, "useful": useful},
        "useful_learner_s": useful, "nominal_step_s": measured, "booked_step_s": nominal, "kept_steps": kept,
        "computed_steps": len(in_window),
        "val_loss": val_loss, "final_val_loss": val_loss[-1][1] if val_loss else summary.get("final_val_loss"),
        "rounds_per_min": _per_minute(kept, log.window_s), "progress_unit": "kept steps",
        "progress": [[float(m["time"]) - start, int(m["step"])] for m in in_window],
        "bytes": int(summary.get("allreduce_bytes", 0) or 0), "bytes_label": "all-reduce bytes (computed)",
        "restarts": max(0, attempts - 1), "attempts": attempts,
    }
    return log, fault_records, extra


def data_parallel_event_log(system_dir: str | Path, *, uptime_bin_s: float = DEFAULT_UPTIME_BIN_S) -> EventLog:
    """The data-parallel system directory in the `ddiloco.goodput` schema."""
    return _data_parallel(Path(system_dir), uptime_bin_s)[0]


def analyze_data_parallel(system_dir: str | Path, *,
                          uptime_bin_s: float = DEFAULT_UPTIME_BIN_S) -> dict[str, Any]:
    """Results of the data-parallel baseline's directory (definitions in the module docstring)."""
    return _results(*_data_parallel(Path(system_dir), uptime_bin_s))


def analyze_system(system_dir: str | Path, *, uptime_bin_s: float = DEFAULT_UPTIME_BIN_S) -> dict[str, Any]:
    system_dir = Path(system_dir)
    if run_info(system_dir).get("system", system_dir.name) == DATA_PARALLEL:
        return analyze_data_parallel(system_dir, uptime_bin_s=uptime_bin_s)
    return analyze_runtime(system_dir, uptime_bin_s=uptime_bin_s)


def analyze_run(run_dir: str | Path, *, uptime_bin_s: float = DEFAULT_UPTIME_BIN_S) -> dict[str, dict[str, Any]]:
    """{system: results} for every system directory the chaos run holds, in SYSTEMS order."""
    run_dir = Path(run_dir)
    return {name: analyze_system(run_dir / name, uptime_bin_s=uptime_bin_s)
            for name in SYSTEMS if (run_dir / name / "chaos" / "run.json").exists()}
