"""The end of a run: merged metrics, `summary.json` and PNG plots (the console's table of it: `report_table`).

Everything is computed from the run directory's files (the process contract), so a report is the
same whether the run finished, was interrupted, or is re-made later; across `--resume` sessions the
sources only grow, and the merge is rewritten from them each time:

- `metrics.jsonl`: every line of `syncer/metrics.jsonl`, `learners/N/metrics.jsonl` and
  `launcher/metrics.jsonl`, tagged with its `source`, sorted by time.
- `summary.json`: per learner restarts, updates accepted and rejected, rounds contributed, tokens, its inner step
  (a position on the run's schedule, at most the budget), the inner steps its processes trained, and the inner step
  its newest checkpoint holds (where `--resume` continues it from: behind its inner step when it was killed after
  that checkpoint, or its checkpoint at its stop could not be written); for the run rounds committed, the latest
  validation loss with when and at which round it was measured (`final_val_loss`, `final_val_loss_time`,
  `final_val_loss_round`: a session without an evaluator measures none, so the latest can be a session's older), wall
  time (this session and all sessions).
- `val_loss.png`, `participation.png` and `bytes.png` (`report_plots`).
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ddiloco.checkpoint import atomic_write_json, iter_jsonl, read_json_object, read_jsonl, state_files, strict_dumps
from ddiloco.runtime.report_plots import VAL_LOSS, write_plots
from ddiloco.runtime.run_paths import RunPaths

logger = logging.getLogger(__name__)



def learner_ids(paths: RunPaths) -> list[int]:
    """Learner ids that have a directory in the run."""
    root = paths.root / "learners"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def metric_sources(paths: RunPaths) -> dict[str, Path]:
    sources = {"syncer": paths.syncer_metrics, "evaluator": paths.evaluator_metrics, "launcher": paths.launcher_metrics}
    for learner_id in learner_ids(paths):
        sources[f"learner/{learner_id}"] = paths.learner_metrics(learner_id)
    return sources


def merge_metrics(paths: RunPaths) -> int:
    """Rewrite `DIR/metrics.jsonl` from every source; returns the number of lines written.

    Each line is tagged with its process (`source`: `syncer`, `learner/N`, ...); a line's own `source` (the syncer's
    `start` and `genesis` events have one) is kept as `event_source`. Each source's file is in time order (one process
    appends it), so the merge streams them, holding a line per source: a long run has a line per learner per inner
    step, millions, which a merge in memory held all at once (1.3 GB for a million). A source out of time order (a
    clock set back between two sessions) is merged in memory, sorted, as before."""
    tmp = paths.metrics.with_name(paths.metrics.name + ".tmp")
    sources = metric_sources(paths)
    try:
        count = _write_merged(tmp, heapq.merge(*(_in_time_order(path, source) for source, path in sources.items()),
                                              key=_time_key))
    except _OutOfOrder as error:
        logger.info("%s is not in time order: merged in memory", error)
        records = [_tagged(record, source) for source, path in sources.items() for record in iter_jsonl(path)]
        records.sort(key=_time_key)
        count = _write_merged(tmp, records)
    os.replace(tmp, paths.metrics)
    return count


class _OutOfOrder(Exception):
    """A metrics file whose lines are not in time order (`merge_metrics`)."""


def _time_key(record: Mapping[str, Any]) -> float:
    return record["time"] if isinstance(record.get("time"), int | float) else 0.0


def _tagged(record: dict[str, Any], source: str) -> dict[str, Any]:
    if "source" in record:
        record["event_source"] = record.pop("source")
    record["source"] = source
    return record


def _in_time_order(path: Path, source: str) -> Iterator[dict[str, Any]]:
    latest = -math.inf
    for record in iter_jsonl(path):
        key = _time_key(record)
        if key < latest:
            raise _OutOfOrder(path)
        latest = key
        yield _tagged(record, source)


def _write_merged(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    count = 0
    with path.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(strict_dumps(record, default=str)[0] + "\n")
            count += 1
        file.flush()
        os.fsync(file.fileno())
    return count


class RoundTotals(NamedTuple):
    """What the summary takes from the round log (`round_totals`): rounds committed, per learner the rounds whose
    participants name it, per fragment the newest version a round records."""

    committed: int
    contributed: Counter[int]
    versions: dict[int, int]


def round_totals(paths: RunPaths) -> RoundTotals:
    """The round log's totals, read a line at a time (a long run's log is gigabytes, `bench_round_log.py`)."""
    committed, contributed, versions = 0, Counter(), {}
    for record in iter_jsonl(paths.rounds):
        committed += 1
        for participant in record.get("participants", []):
            contributed[int(participant["learner_id"])] += 1
        fragment, version = record.get("fragment"), record.get("version")
        if isinstance(fragment, int) and isinstance(version, int):
            versions[fragment] = max(versions.get(fragment, version), version)
    return RoundTotals(committed, contributed, versions)


class ValLoss(NamedTuple):
    """A validation loss of the global model, as the evaluator measured it."""

    value: float | None
    """None: not finite, or none measured."""
    time: float | None
    """Wall time (Unix seconds) of the measurement."""
    round: int | None
    """Rounds committed when it was measured (the evaluator's `eval/rounds_committed`, its metrics' step)."""


def final_val_loss(paths: RunPaths) -> ValLoss:
    """The latest validation loss from the evaluator's metrics, else its status file. A latest loss that was not
    finite (null in the file, or NaN in one written before files were strict JSON) is None: the one before it is not
    the final one."""
    latest: ValLoss | None = None
    for record in read_jsonl(paths.evaluator_metrics):
        if VAL_LOSS in record:
            latest = ValLoss(_finite(record[VAL_LOSS]), record.get("time"),
                             _round(record.get("eval/rounds_committed", record.get("step"))))
    if latest is None:
        status = read_json_object(paths.evaluator_status) or {}
        value = status.get("val_loss")
        latest = (ValLoss(_finite(value), status.get("time"), _round(status.get("rounds_committed")))
                  if isinstance(value, int | float) else ValLoss(None, None, None))
    return latest


def _round(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _launcher_events(paths: RunPaths) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(paths.launcher_metrics) if "event" in r]


def _sessions_wall_s(events: list[dict[str, Any]]) -> float:
    """Seconds of every session of the run: a session's `run_finished` wall time; one that ended without it (its
    launcher killed) from its `run_started` to its last event, which it lasted at least (it counted 0 before)."""
    sessions: list[list[dict[str, Any]]] = []
    for event in events:
        if event["event"] == "run_started":
            sessions.append([])
        if sessions:
            sessions[-1].append(event)
    total = 0.0
    for session in sessions:
        finished = [e for e in session if e["event"] == "run_finished"]
        if finished:
            total += float(finished[-1].get("wall_time_s", 0.0))
            continue
        times = [e["time"] for e in session if isinstance(e.get("time"), int | float)]
        total += max(times) - times[0] if times else 0.0
    return total


def build_summary(paths: RunPaths, *, num_learners: int, outcome: str, wall_time_s: float,
                  final_states: Mapping[int, tuple[str, str]] | None = None,
                  failure: str | None = None, evaluator: tuple[str, str] | None = None) -> dict[str, Any]:
    """The content of summary.json. `final_states`: learner id -> (state, reason) of this session; `evaluator`: the
    evaluator's (None: the run had none)."""
    final_states = final_states or {}
    events = _launcher_events(paths)
    # A restart is scheduled after a backoff, or a standby syncer takes over at once.
    restarts = Counter(e.get("name") for e in events if e["event"] in ("restart_scheduled", "taken_over"))
    rounds = round_totals(paths)
    syncer_status = read_json_object(paths.syncer_status) or {}
    per_learner_syncer = syncer_status.get("learners") or {}
    learners = {}
    for learner_id in sorted(set(range(num_learners)) | set(learner_ids(paths))):
        status = read_json_object(paths.learner_status(learner_id)) or {}
        from_syncer = per_learner_syncer.get(str(learner_id)) or {}
        state, reason = final_states.get(learner_id, (str(status.get("state", "unknown")), ""))
        position, budget = status.get("inner_step"), status.get("inner_steps")
        saved = checkpoint_inner_step(paths.learner_dir(learner_id))
        published, accepted = ledger_updates(paths.learner_dir(learner_id))
        if isinstance(position, int) and isinstance(budget, int):  # (a status written before the learner capped it)
            position = min(position, max(budget, saved or 0))  # its own checkpoint's step is its own progress
        learners[str(learner_id)] = {
            "state": state,
            "reason": reason,
            "restarts": restarts.get(f"learner-{learner_id}", 0),
            "inner_step": position,
            "inner_steps_trained": inner_steps_trained(paths.learner_dir(learner_id), learner_id),
            "checkpoint_inner_step": saved,
            "updates_sent": _at_least(status.get("updates_sent"), max(published, (from_syncer.get("accepted") or 0)
                                                                       + (from_syncer.get("rejected") or 0))),
            # The learner's own count, as its status.json says: an update that missed its round is accepted and folded
            # into its next one, so the rounds it took part in (the syncer's count, `rounds_contributed`) can be fewer.
            "updates_accepted": _at_least(status.get("updates_accepted"),
                                          max(accepted, from_syncer.get("accepted") or 0)),
            "updates_rejected": from_syncer.get("rejected", status.get("updates_rejected")),
            "rounds_contributed": rounds.contributed.get(learner_id, 0),
            "tokens": status.get("tokens"),
            "tokens_merged": from_syncer.get("tokens_merged"),
            "bytes_sent": status.get("bytes_sent"),
            "genesis_bytes_sent": status.get("genesis_bytes_sent", 0),  # of bytes_sent: the initial model it proposed
            "bytes_received": status.get("bytes_received"),
            "joins": from_syncer.get("joins", status.get("joins")),
            "non_finite_recoveries": status.get("non_finite_recoveries", 0),
            "updates_capped": from_syncer.get("capped", 0),
            "step_time_s": from_syncer.get("step_time_s"),  # the syncer's moving averages at the run's end
            "path_time_s": from_syncer.get("path_time_s"),
        }
    val_loss = final_val_loss(paths)
    total_wall_s = _sessions_wall_s(events)
    return {
        "run_dir": str(paths.root.absolute()),  # as a new run writes it: a --resume RUN was relative
        "outcome": outcome,
        "failure": failure,
        "evaluator": None if evaluator is None else {"state": evaluator[0], "reason": evaluator[1] or None},
        "num_learners": num_learners,
        "rounds_committed": rounds.committed,
        "final_val_loss": val_loss.value,
        "final_val_loss_time": val_loss.time,
        "final_val_loss_round": val_loss.round,
        "wall_time_s": round(wall_time_s, 3),
        "wall_time_total_s": round(max(total_wall_s, wall_time_s), 3),
        "sessions": sum(1 for e in events if e["event"] == "run_started"),
        "syncer": {
            "restarts": restarts.get("syncer", 0),
            "versions": _versions(syncer_status.get("versions"), rounds.versions),
            "bytes_received": syncer_status.get("bytes_received"),
            "bytes_sent": syncer_status.get("bytes_sent"),
            "bytes_watched": syncer_status.get("bytes_watched"),
            "rejections": syncer_status.get("rejections") or {},
            "storage_error": syncer_status.get("storage_error"),
        },
        "learners": learners,
    }


def _at_least(reported: Any, known: int) -> Any:
    """A count from a status file, raised to what the syncer's records show (`known`): status files are rewritten
    once a second, so one killed with its process lags by what happened in its last second."""
    return max(reported, known) if isinstance(reported, int) else (known or reported)


def _versions(reported: Any, logged: Mapping[int, int]) -> Any:
    """Each fragment's version: the syncer status's, raised to the newest the round log records (`logged`, the durable
    record: the status of a syncer killed with SIGKILL lags by its last second)."""
    if not isinstance(reported, list) or not all(isinstance(v, int) for v in reported):
        return reported
    return [max(version, logged.get(fragment, version)) for fragment, version in enumerate(reported)]


def ledger_updates(learner_dir: Path) -> tuple[int, int]:
    """(updates published, updates the syncer accepted) by the learner's work ledger, every process of it: a line per
    publish and per fate, appended as they happen, so a kill -9 loses none of them, where status.json, rewritten once a
    second, lags by its last second at each kill (an audit: 85 sent and accepted reported after 3 kills, 89 in the
    ledger and the syncer's log)."""
    published = accepted = 0
    for event in iter_jsonl(learner_dir / "work.jsonl"):
        kind = event.get("event")
        fate = event.get("fate") if kind == "fate" else None
        published += (kind == "publish") - (fate == "withheld")  # (withheld: never sent after all)
        accepted += fate == "accepted"
    return published, accepted


def inner_steps_trained(learner_dir: Path, learner_id: int) -> int | None:
    """Inner steps the learner's processes trained, summed over its starts; None without a work ledger.

    `inner_step` is a position on the run's schedule: a learner with no checkpoint of its own takes the run's when it
    joins, so a learner whose first process trained 40 steps and crashed before any checkpoint, and whose next process
    joined once the others had finished, reports the budget having trained 40. Each start is cut from the work ledger
    (`learners/N/work.jsonl`, at each "start"): it trained from the step it began at (its checkpoint's, or the position
    it took) to the last step it reached (its ledger's events and the step lines of `learners/N/metrics.jsonl` in its
    time window: a process killed without a trace counts to its last step line). Steps trained again after a restart
    from a checkpoint count again: this is work done, not progress."""
    starts: list[_Start] = []  # streamed: a long run's ledger and metrics hold a line per publish and per step
    for event in iter_jsonl(learner_dir / "work.jsonl"):
        if event.get("event") == "start" or not starts:
            first = int(event.get("inner_step", 0))
            starts.append(_Start(float(event.get("time", -math.inf)), first, first))
        start = starts[-1]
        if event.get("event") == "position":  # the run's position, taken at the join, before any step
            start.first = int(event["inner_step"])
        if isinstance(event.get("inner_step"), int):
            start.reached = max(start.reached, int(event["inner_step"]))
    if not starts:
        return None
    begins = [start.begin for start in starts]
    ends = [*begins[1:], math.inf]  # each start's window: from its time to the next start's
    in_order = begins == sorted(begins)
    tokens_key = f"learner/{learner_id}/tokens"  # logged at every inner step
    for line in iter_jsonl(learner_dir / "metrics.jsonl"):
        step, time = line.get("step"), line.get("time")
        if tokens_key not in line or not isinstance(step, int) or not isinstance(time, int | float):
            continue
        for index in ([bisect.bisect_right(begins, time) - 1] if in_order else range(len(starts))):
            if index >= 0 and begins[index] <= time < ends[index]:
                starts[index].reached = max(starts[index].reached, step)
    trained = sum(max(0, start.reached - start.first) for start in starts)
    return trained


@dataclass
class _Start:
    """One start of a learner's processes in its work ledger (`inner_steps_trained`)."""

    begin: float
    first: int
    """The inner step it began at: its checkpoint's, or the run's position it took."""
    reached: int
    """The last inner step it reached (events and step lines)."""


def checkpoint_inner_step(learner_dir: Path) -> int | None:
    """The inner step the learner's newest checkpoint (`learners/N/checkpoint/`) holds, where `--resume` continues it
    from; None when it has none (a resume then takes the run's position). Read from the file names, the way a resume
    finds it (a state exists once its JSON does), not from status.json: a learner killed after its last checkpoint,
    or whose checkpoint at its stop could not be written, reported steps its checkpoint does not hold. A report
    reads no tensors, so a newest checkpoint that turns out damaged at the resume, skipped for the one before it, is
    not foreseen here."""
    states = state_files(learner_dir / "checkpoint")
    return states[-1][0] if states else None


def unsaved_progress(row: Mapping[str, Any]) -> int | None:
    """The inner step a `--resume` continues the learner of a summary row from, where that is behind the inner step
    it reports; None when its newest checkpoint holds its progress (or it has none)."""
    position, saved = row.get("inner_step"), row.get("checkpoint_inner_step")
    return saved if isinstance(position, int) and isinstance(saved, int) and saved < position else None


def write_summary(paths: RunPaths, summary: Mapping[str, Any]) -> None:
    atomic_write_json(paths.summary, summary)


def write_report(paths: RunPaths, *, num_learners: int, outcome: str, wall_time_s: float,
                 final_states: Mapping[int, tuple[str, str]] | None = None,
                 failure: str | None = None, evaluator: tuple[str, str] | None = None) -> dict[str, Any]:
    """Merge metrics, write summary.json and the plots; returns the summary."""
    merge_metrics(paths)
    summary = build_summary(paths, num_learners=num_learners, outcome=outcome, wall_time_s=wall_time_s,
                            final_states=final_states, failure=failure, evaluator=evaluator)
    write_summary(paths, summary)
    write_plots(paths, summary)
    return summary
