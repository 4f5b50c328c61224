"""What a running `ddiloco run` shows: a live rich table, or one line per event for scripts and CI.

Reads only files of the process contract (`DIR/syncer_status.json`, `DIR/learners/N/status.json`,
rewritten by the children about once a second) and the supervisor's own state (process state,
restarts); it never talks to the children. With a terminal it redraws ~2x per second; with
`--no-progress` or when stdout is not a terminal it prints a line per learner event (start, state
change, exit, restart, done) and a short syncer line every `LINE_SUMMARY_EVERY_S`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.runtime.supervised_roles import ChildState, Event, Slot
from ddiloco.runtime.supervisor import Supervisor

REFRESH_INTERVAL_S = 0.5
"""Redraw (and status-file read) interval: about twice per second."""
LINE_SUMMARY_EVERY_S = 15.0
"""In line mode, how often a one-line syncer summary is printed between events."""
RECENT_EVENTS = 6
"""Events shown under the live tables."""
SHUTDOWN_EVENTS = frozenset({"stopping", "waiting", "stopped"})
"""Events after which the live view is redrawn at once: while the run stops, nothing else redraws it."""


def format_bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def _num(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if not isinstance(value, int | float) else f"{value:{spec}}{suffix}"


def val_loss_text(status: dict[str, Any]) -> str:
    """The evaluator's latest validation loss with the round it was measured at ("5.543 at round 0"): it evaluates
    every --eval-every-s, so beside the syncer's round count the bare number read as the current model's (216 rounds,
    val loss 5.543: the loss of round 0)."""
    loss, measured = status.get("val_loss"), status.get("val_loss_round")
    if not isinstance(loss, int | float):
        return "-"
    return f"{loss:.3f}" + (f" at round {measured}" if isinstance(measured, int) else "")


@dataclass(frozen=True)
class LearnerRow:
    """One learner as shown: the supervisor's view merged with its latest status file."""

    learner_id: int
    pid: int | None
    """The running process (kill -9 it to watch the supervisor heal the run)."""
    state: str
    inner_step: int | None
    inner_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    rounds: int | None
    """Updates the syncer merged (rounds this learner contributed to)."""
    restarts: int


def learner_state(slot: Slot, status: Mapping[str, Any] | None, now: float) -> str:
    """The state a person wants to see: the process state, or the learner's own once it runs."""
    if slot.state == ChildState.BACKOFF and slot.restart_at is not None:
        return f"restart in {max(0.0, slot.restart_at - now):.1f}s"
    if slot.state == ChildState.RUNNING:
        if status is None or status.get("pid") != slot.pid:
            return "starting"
        return str(status.get("state", "running"))
    return str(slot.state)


AWAY_AFTER_S = 10.0
"""A running learner whose status file is this much older than the syncer's is not writing it: stopped or hung."""


def learner_row(slot: Slot, status: Mapping[str, Any] | None, syncer_status: Mapping[str, Any] | None,
                now: float) -> LearnerRow:
    assert slot.learner_id is not None
    status = status or {}
    per_learner = ((syncer_status or {}).get("learners") or {}).get(str(slot.learner_id)) or {}
    rounds = per_learner.get("accepted", status.get("updates_accepted"))
    state = learner_state(slot, status or None, now)
    if per_learner.get("stalled") and slot.state == ChildState.RUNNING:
        state = f"stalled ({state})"  # alive to the syncer, without updates: rounds do not wait for it
    elif state in ("training", "waiting") and per_learner.get("alive") is False and (
            status.get("connected") is False
            or float((syncer_status or {}).get("time", 0)) - float(status.get("time", 0)) > AWAY_AFTER_S):
        # The syncer stopped counting it (its heartbeats stopped: a process stopped, a link cut) and the learner is
        # cut off, or has not written its status for a while: a probe's stopped learner went quiet without a word.
        state = f"away ({state})"
    return LearnerRow(slot.learner_id, slot.pid, state, status.get("inner_step"),
                      status.get("inner_steps"), status.get("loss"), status.get("tokens_per_s"), rounds,
                      slot.restarts)


def learners_table(rows: list[LearnerRow]) -> Table:
    table = Table(title="learners", title_justify="left", expand=False)
    for header in ("learner", "pid", "state", "inner step", "loss", "tokens/s", "rounds", "restarts"):
        table.add_column(header, justify="left" if header == "state" else "right")
    for row in rows:
        step = "-" if row.inner_step is None else f"{row.inner_step}/{row.inner_steps or '?'}"
        style = {"done": "green", "refused": "red", "unreachable": "red", "failed": "red", "disconnected": "yellow",
                 "waiting": "yellow", "stalled": "yellow", "away": "yellow"}.get(row.state.split()[0], "")
        table.add_row(str(row.learner_id), _num(row.pid, "d"), Text(row.state, style=style), step,
                      _num(row.loss, ".3f"), _num(row.tokens_per_s, ",.0f"), _num(row.rounds, "d"), str(row.restarts))
    return table


def quorum_text(status: Mapping[str, Any]) -> str:
    """The syncer's effective quorum of its minimum, of the learners alive and those of them stalled (alive without
    updates: rounds do not wait for them)."""
    if "effective_quorum" not in status:
        return "-"
    alive = len(status.get("alive_learners", []))
    text = f"{status['effective_quorum']}/{status.get('min_quorum', '?')} of {alive} alive"
    stalled = status.get("stalled_learners") or []
    return text + (f", {len(stalled)} stalled" if stalled else "")


def syncer_table(slot: Slot, status: Mapping[str, Any] | None) -> Table:
    table = Table(title="syncer", title_justify="left", expand=False)
    status = status or {}
    columns = {
        "state": str(slot.state) + (f" (restarts {slot.restarts})" if slot.restarts else ""),
        "rounds": _num(status.get("rounds_committed"), "d"),
        "versions": " ".join(str(v) for v in status.get("versions", [])) or "-",
        "quorum": quorum_text(status),
        "grace": _num(status.get("grace_s"), ".2f", "s"),
        "step/quorum/sync": "/".join(_num(status.get(k), ".2f") for k in ("step_time_s", "quorum_time_s",
                                                                          "sync_time_s")) + " s",
        "rejections": ", ".join(f"{k} {v}" for k, v in sorted((status.get("rejections") or {}).items())) or "0",
        "bytes in/out": f"{format_bytes(status.get('bytes_received'))} / {format_bytes(status.get('bytes_sent'))}",
        "val loss": val_loss_text(status),
    }
    for header in columns:
        table.add_column(header, justify="left")
    table.add_row(*columns.values())
    return table


class ProgressView:
    """Live tables (terminal) or event lines (scripts). Feed it `on_event` and call `tick()`."""

    def __init__(self, paths: RunPaths, supervisor: Supervisor, *, console: Console, live: bool) -> None:
        self.paths = paths
        self.supervisor = supervisor
        self.console = console
        self.live = live
        self._live: Live | None = None
        self._events: deque[str] = deque(maxlen=RECENT_EVENTS)
        self._last_refresh = float("-inf")
        self._last_summary = time.monotonic()
        self._shown_states: dict[int, str] = {}
        self._storage_error: str | None = None

    def __enter__(self) -> ProgressView:
        if self.live:
            # No auto-refresh thread: the supervisor loop redraws, so the launcher stays one thread
            # (its children are forked from it, see launcher.die_with_parent).
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            self._live.stop()
            self._live = None

    def on_event(self, event: Event) -> None:
        line = f"{time.strftime('%H:%M:%S')} [{event.name}] {event.message}"
        if self._live is not None:
            self._events.append(line)
            if event.kind in SHUTDOWN_EVENTS:  # no tick redraws the view while the run stops
                self._live.update(self.render(), refresh=True)
        else:
            self._print(line)

    def _print(self, line: str) -> None:
        # Names like "[learner-1]" are not rich markup.
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_refresh < REFRESH_INTERVAL_S:
            return
        self._last_refresh = now
        snapshot = self.snapshot()  # each status file read once a tick
        self._note_storage_error(snapshot[0])
        if self._live is not None:
            self._live.update(self.render(snapshot), refresh=True)
        else:
            self._print_changes(now, snapshot)

    def _note_storage_error(self, syncer_status: Mapping[str, Any] | None) -> None:
        """Say when the syncer starts and stops failing to make its rounds durable (a full disk): meanwhile every
        update is refused as `unavailable`, and the run's lines would otherwise only show no rounds committed."""
        error = (syncer_status or {}).get("storage_error")
        if error == self._storage_error:
            return
        self._storage_error = error
        line = (f"{time.strftime('%H:%M:%S')} [syncer] " + (f"cannot commit rounds: {error}; updates are refused "
                                                            "until it can" if error else "commits rounds again"))
        if self._live is not None:
            self._events.append(line)
        else:
            self._print(line)

    def snapshot(self) -> tuple[dict[str, Any] | None, list[LearnerRow]]:
        now = time.monotonic()
        syncer_status = read_json_object(self.paths.syncer_status)
        evaluator = read_json_object(self.paths.evaluator_status) or {}
        if syncer_status is not None:  # the validation loss comes from the evaluator (ddiloco.watch)
            syncer_status = {**syncer_status, "val_loss": evaluator.get("val_loss"),
                             "val_loss_round": evaluator.get("rounds_committed")}
        rows = [learner_row(slot, read_json_object(self.paths.learner_status(slot.learner_id)), syncer_status, now)
                for slot in self.supervisor.learners if slot.learner_id is not None]
        return syncer_status, rows

    def render(self, snapshot: tuple[dict[str, Any] | None, list[LearnerRow]] | None = None) -> Group:
        syncer_status, rows = snapshot or self.snapshot()
        parts: list[Any] = [syncer_table(self.supervisor.syncer, syncer_status), learners_table(rows)]
        if self._events:
            parts.append(Text("\n".join(self._events), style="dim"))
        return Group(*parts)

    def _print_changes(self, now: float, snapshot: tuple[dict[str, Any] | None, list[LearnerRow]]) -> None:
        syncer_status, rows = snapshot
        for slot, row in zip(self.supervisor.learners, rows, strict=True):
            # Only the learner's own states (from its status file); process states arrive as events.
            if slot.state == ChildState.RUNNING and row.state != "starting" \
                    and self._shown_states.get(row.learner_id) != row.state:
                self._shown_states[row.learner_id] = row.state
                if row.state == "joining" and slot.restarts and not row.inner_step:
                    # Restarted with no checkpoint of its own: the Welcome gives it the run's position (a probe
                    # read "joining at inner step 0/300", then the learner trained on from 171).
                    where = "without a checkpoint of its own: it takes the run's position"
                else:
                    where = f"at inner step {row.inner_step}/{row.inner_steps}, loss {_num(row.loss, '.3f')}"
                self._print(f"{time.strftime('%H:%M:%S')} [learner-{row.learner_id}] {row.state} {where}")
        if now - self._last_summary >= LINE_SUMMARY_EVERY_S and syncer_status is not None:
            self._last_summary = now
            steps = " ".join(f"{r.learner_id}:{r.inner_step}" for r in rows)
            self._print(f"{time.strftime('%H:%M:%S')} [syncer] {syncer_status.get('rounds_committed', 0)} rounds, "
                        f"val loss {val_loss_text(syncer_status)}, inner steps {steps}")
