"""Metric sinks: one small interface, several back ends.

`log(metrics, step)` takes flat, slash-separated names (`learner/3/loss`,
`syncer/fragment/2/staleness`); `event(kind, **fields)` records a structured event (a fault, a
join, a commit, a rejection). Back ends: JSONL (always), TensorBoard (when installed), in-memory
(tests, experiments) and null; `CompositeSink` fans out to several.
"""

from __future__ import annotations

import json
import logging
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
    None when tensorboard is not installed."""

    def __init__(self, log_dir: str | Path, writer_cls) -> None:
        self._writer = writer_cls(str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            if isinstance(value, int | float):
                self._writer.add_scalar(name, value, step)

    def event(self, kind: str, **fields: Any) -> None:
        self._writer.add_text(f"events/{kind}", json.dumps(fields, default=str))

    def close(self) -> None:
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
