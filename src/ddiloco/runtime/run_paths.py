"""Where everything lives in a run directory: the file names every process of a run agrees on.

The launcher, the syncer, the learners, the evaluator and the commands that read a run afterwards (`ddiloco export`,
`--resume`, the report) all find its files through `RunPaths`; what the launcher records there and the checks made
before a run starts are `ddiloco.runtime.run_dir`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """Where everything lives in a run directory (the contract's file names)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def syncer_json(self) -> Path:
        return self.root / "syncer.json"

    @property
    def syncer_status(self) -> Path:
        return self.root / "syncer_status.json"

    @property
    def syncer_metrics(self) -> Path:
        return self.root / "syncer" / "metrics.jsonl"

    @property
    def evaluator_metrics(self) -> Path:
        return self.root / "evaluator" / "metrics.jsonl"

    @property
    def evaluator_status(self) -> Path:
        return self.root / "evaluator" / "status.json"

    @property
    def rounds(self) -> Path:
        return self.root / "rounds.jsonl"

    @property
    def launcher_metrics(self) -> Path:
        return self.root / "launcher" / "metrics.jsonl"

    @property
    def processes(self) -> Path:
        return self.root / "launcher" / "processes.json"

    @property
    def learner_command(self) -> Path:
        """The learner command the run last started with (`run_dir.record_learner_command`)."""
        return self.root / "launcher" / "command.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def learner_dir(self, learner_id: int) -> Path:
        return self.root / "learners" / str(learner_id)

    def learner_status(self, learner_id: int) -> Path:
        return self.learner_dir(learner_id) / "status.json"

    def learner_metrics(self, learner_id: int) -> Path:
        return self.learner_dir(learner_id) / "metrics.jsonl"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def settings(self, name: str) -> Path:
        """Child `name`'s settings file (`ddiloco syncer|learner|evaluator --settings FILE`)."""
        return self.root / "settings" / f"{name}.json"
