"""What a learner session (`ddiloco.learner_session.Session`) says about itself while it runs.

Owns the learner's progress as the status thread reads it (state, inner step, loss, tokens, fragment
versions: replaced, never mutated, by the training thread), its counters (the learner core's and the
transport's, plus the totals of earlier incarnations that its checkpoint carried over), its token rate, and
`learners/N/status.json`, rewritten every `status_every_s` by a background thread that also logs the token
rate, with the inner step its newest checkpoint holds (`checkpoint_inner_step`, which its checkpoint sets). What
the checkpoint keeps of it is `ddiloco.learner_checkpoint`'s; when the state changes is the session's.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.checkpoint import WriteTrouble, atomic_write_json, read_json_object
from ddiloco.learner import Learner
from ddiloco.metrics import MetricSink
from ddiloco.session_transport import SessionTransport

COUNTERS = ("updates_sent", "updates_accepted", "updates_rejected", "updates_dropped", "fragments_applied",
            "bytes_sent", "bytes_received", "joins", "waits_abandoned", "non_finite_recoveries", "publishes_waited",
            "genesis_bytes_sent")
"""Counters reported in status.json, carried across restarts by the checkpoint and by the last status.json
(`StatusReporter.carry_over`)."""


@dataclass
class Progress:
    """What the status thread reads; replaced (not mutated) by the training thread."""

    state: str = "joining"
    inner_step: int = 0
    loss: float | None = None
    tokens: int = 0
    versions: list[int] = field(default_factory=list)


class StatusReporter:
    """The progress, counters and status file of one learner (see the module docstring)."""

    def __init__(self, learner: Learner, transport: SessionTransport, *, inner_steps: int, directory: Path | None,
                 every_s: float, sink: MetricSink, prefix: str) -> None:
        self.learner = learner
        self.transport = transport
        self.inner_steps = inner_steps
        """The run's inner-step budget, as status.json reports it."""
        self.directory = directory
        """learners/N/ of the run directory, or None: no status file."""
        self.every_s = every_s
        self.sink = sink
        self.prefix = prefix
        self.base: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        """The counters' totals before this process (from the checkpoint it resumed)."""
        self.progress = Progress()
        self.checkpoint_inner_step: int | None = None
        """The inner step the learner's newest checkpoint holds, where a restart continues from (None: it has none);
        set by its checkpoint (`ddiloco.learner_checkpoint`) when it restores one and after each write that worked.
        Behind `inner_step` in the final status when the checkpoint at the stop could not be written."""
        self.restored_inner_step: int | None = None
        """The inner step of the checkpoint this process restored (None: it restored none): the learner's own progress
        from before, which the status reports even past a smaller budget of this process."""
        self.stop_requested = False
        """Whether the session was asked to stop (a SIGTERM to it or to one of its ranks, `request_stop()`), as its
        final status says: a launcher restarts a learner stopped that way before the budget, but not one whose own
        loop ended there (`ddiloco.runtime.learner_exits.stopped_from_outside`)."""
        self._last_rate = (time.monotonic(), 0)
        self.tokens_per_s = 0.0
        self._writes = WriteTrouble(f"learner {learner.learner_id}'s status file")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, **changes: Any) -> None:
        """Replace the progress: the learner's inner step and versions as they are now, with `changes`. The inner step
        is reported at most at the budget: a learner with no checkpoint takes the run's schedule position when it joins
        (`Learner.take_schedule_position`), past the budget if the others finished meanwhile, and is then done at once
        without training; its position beyond the budget is no progress of its own (summary.json says what it trained,
        `ddiloco.runtime.report`). Its own checkpoint's step is: a resume with a smaller budget reports that."""
        reached = max(self.inner_steps, self.restored_inner_step or 0)
        values = {**self.progress.__dict__, "inner_step": min(self.learner.inner_step, reached),
                  "versions": list(self.learner.versions), **changes}
        self.progress = Progress(**values)

    def counters(self) -> dict[str, int]:
        stats = self.learner.stats
        current = {"updates_sent": stats.updates_sent, "fragments_applied": stats.fragments_applied,
                   "waits_abandoned": stats.waits_abandoned, "non_finite_recoveries": stats.non_finite_recoveries,
                   "publishes_waited": stats.publishes_waited, **self.transport.counters()}
        return {name: self.base[name] + current[name] for name in COUNTERS}

    def resume(self, *, tokens: int, counters: dict[str, Any]) -> None:
        """Continue from a checkpoint's totals: its tokens and counters."""
        self.base.update({k: int(v) for k, v in counters.items() if k in self.base})
        self.set(tokens=tokens)
        self._last_rate = (time.monotonic(), self.progress.tokens)

    def carry_over(self, *, restored: bool) -> None:
        """Count the learner's earlier processes as the status.json the last one left says, where that is more than
        the checkpoint carried: a process killed before its first checkpoint (or work done after its last one) would
        otherwise be forgotten by the next one's counters. Without a checkpoint (`restored` False) the tokens go on
        from that file too: the learner took the run's position, and its tokens are those its processes trained."""
        earlier = read_json_object(self.directory / "status.json") if self.directory is not None else None
        if earlier is None or earlier.get("learner_id") != self.learner.learner_id:
            return
        for name in COUNTERS:
            if isinstance(earlier.get(name), int):
                self.base[name] = max(self.base[name], earlier[name])
        if not restored and isinstance(earlier.get("tokens"), int):
            self.resume(tokens=earlier["tokens"], counters={})

    def status(self) -> dict[str, Any]:
        progress = self.progress
        now = time.monotonic()
        last_time, last_tokens = self._last_rate
        if now > last_time:
            self.tokens_per_s = (progress.tokens - last_tokens) / (now - last_time)
        self._last_rate = (now, progress.tokens)
        return {"time": time.time(), "pid": os.getpid(), "learner_id": self.learner.learner_id,
                "state": progress.state, "inner_step": progress.inner_step,
                "inner_steps": self.inner_steps, "loss": progress.loss,
                "tokens_per_s": self.tokens_per_s, "tokens": progress.tokens, "versions": progress.versions,
                "connected": self.transport.connected, "stop_requested": self.stop_requested,
                "checkpoint_inner_step": self.checkpoint_inner_step, **self.counters()}

    def write(self) -> None:
        assert self.directory is not None
        status = self.status()
        self._writes.attempt(lambda: atomic_write_json(self.directory / "status.json", status, durable=False))

    def start(self) -> None:
        """With a directory: the status thread starts writing status.json."""
        if self.directory is not None:
            self._thread = threading.Thread(target=self._loop, name="learner-status", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """The status thread (if any) ends; status.json is written once more, with the final state."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.write()

    def _loop(self) -> None:
        self.write()
        while not self._stop.wait(self.every_s):
            self.write()
            self.sink.log({f"{self.prefix}/tokens_per_s": self.tokens_per_s}, step=self.progress.inner_step)
