"""Metric sinks: one small interface, several back ends.

`log(metrics, step)` takes flat, slash-separated names (`learner/3/loss`,
`syncer/fragment/2/staleness`); `event(kind, **fields)` records a structured event (a fault, a
join, a commit, a rejection). Back ends: JSONL (always), TensorBoard (when installed), in-memory
(tests, experiments) and null; `CompositeSink` fans out to several.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ddiloco.checkpoint import JsonLines

logger = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def event(self, kind: str, **fields: Any) -> None: ...
    def close(self) -> None: ...


class NullSink:
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


class MemorySink:
    """Keeps everything in lists; for tests and in-process experiments."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.events: list[dict[str, Any]] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, **fields})

    def close(self) -> None:
        pass

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, m[name]) for step, m in self.records if name in m]


class JsonlSink:
    """One JSON object per line: {"step", "time", metrics...} or {"event", "time", fields...}, in a
    `JsonLines` file: each line written whole as it comes, so a run killed with SIGKILL still leaves every
    line it logged, several threads (a syncer's gRPC handlers) may log at once, and a full disk drops lines
    whole (counted in a `dropped_lines` line) instead of stopping the run."""

    def __init__(self, path: str | Path, *, wall_clock=time.time) -> None:
        self.path = Path(path)
        self._lines = JsonLines(self.path, wall_clock=wall_clock)
        self._wall_clock = wall_clock

    @property
    def dropped(self) -> int:
        return self._lines.dropped

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._lines.append({"step": step, "time": self._wall_clock(), **metrics})

    def event(self, kind: str, **fields: Any) -> None:
        self._lines.append({"event": kind, "time": self._wall_clock(), **fields})

    def close(self) -> None:
        self._lines.close()


class TensorBoardSink:
    """Scalars into TensorBoard event files. Construct through `tensorboard_sink`, which returns
    None when tensorboard is not installed.

    The writer opens at the first scalar. When the directory holds event files already (a restarted process: a learner
    resumed from its checkpoint, a syncer from its state), it opens with `purge_step` at that first step, so TensorBoard
    hides what the earlier process logged from there on, the steps the restart redoes: without it the curves go back
    over them (858 points for 800 steps, 58 twice). An event is text at the latest step logged (all at step 0,
    TensorBoard would keep only 10 of them); those before the first scalar wait for it."""

    def __init__(self, log_dir: str | Path, writer_cls) -> None:
        self._log_dir = Path(log_dir)
        self._writer_cls = writer_cls
        self._writer = None
        self._step = 0
        self._waiting: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _open(self, step: int | None) -> Any:
        earlier = self._log_dir.is_dir() and any(self._log_dir.glob("events.out.tfevents.*"))
        writer = self._writer_cls(str(self._log_dir), purge_step=step if earlier else None)
        for tag, text in self._waiting:
            writer.add_text(tag, text, self._step)
        self._waiting.clear()
        return writer

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with self._lock:
            self._step = step
            if self._writer is None:
                self._writer = self._open(step)
            for name, value in metrics.items():
                if isinstance(value, int | float):
                    self._writer.add_scalar(name, value, step)

    def event(self, kind: str, **fields: Any) -> None:
        text = json.dumps(fields, default=str)
        with self._lock:
            if self._writer is None:
                self._waiting.append((f"events/{kind}", text))
            else:
                self._writer.add_text(f"events/{kind}", text, self._step)

    def close(self) -> None:
        with self._lock:
            if self._writer is None and self._waiting:
                self._writer = self._open(None)
            if self._writer is not None:
                self._writer.close()


def tensorboard_sink(log_dir: str | Path) -> TensorBoardSink | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.debug("tensorboard is not installed; no TensorBoard event files")
        return None
    return TensorBoardSink(log_dir, SummaryWriter)


class CompositeSink:
    def __init__(self, sinks: Iterable[MetricSink]) -> None:
        self.sinks = list(sinks)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def event(self, kind: str, **fields: Any) -> None:
        for sink in self.sinks:
            sink.event(kind, **fields)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def run_dir_sink(run_dir: str | Path, *, name: str = "metrics.jsonl") -> MetricSink:
    """The standard sink of a run directory: JSONL, plus TensorBoard when it is installed."""
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = [JsonlSink(run_dir / name)]
    board = tensorboard_sink(run_dir / "tensorboard")
    if board is not None:
        sinks.append(board)
    return CompositeSink(sinks)
