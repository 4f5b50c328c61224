"""The resolved configuration of a whole run: every component's config plus the run's own fields.

One JSON file (`config.json` in the run directory) holds it, so the syncer, every learner process and
a later `--resume` read exactly the same settings. Cross-field checks live here (STYLE.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.config import DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.data import VOCAB_SIZE, DataConfig
from ddiloco.flags import add_config_flags, config_from_args
from ddiloco.model import ModelConfig
from ddiloco.training import InnerConfig

SECTIONS: dict[str, tuple[type, str]] = {
    "diloco": (DilocoConfig, ""),
    "quorum": (QuorumConfig, ""),
    "learner": (LearnerConfig, ""),
    "inner": (InnerConfig, "inner_"),
    "model": (ModelConfig, "model_"),
    "data": (DataConfig, "data_"),
}
"""Section name -> (config class, command-line flag prefix)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a run needs besides addresses and paths."""

    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    num_learners: int = 4
    """M: learner processes in the run."""
    inner_steps: int = 600
    """Inner steps each learner trains before it leaves."""
    seed: int = 0
    """Seed of the global model's initialisation (done once, by the syncer)."""

    def __post_init__(self) -> None:
        if self.num_learners < 1:
            raise ValueError(f"num_learners={self.num_learners} is invalid: expected an integer >= 1")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps={self.inner_steps} is invalid: expected an integer >= 1")
        if self.data.context_len != self.model.context_len:
            raise ValueError(f"data_context_len={self.data.context_len} must equal "
                             f"model_context_len={self.model.context_len}")
        if self.model.vocab_size != VOCAB_SIZE:
            raise ValueError(f"model_vocab_size={self.model.vocab_size} must be {VOCAB_SIZE}: tokens are bytes")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown run config field(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name in SECTIONS:
                section_cls = SECTIONS[name][0]
                section_fields = {f.name for f in dataclasses.fields(section_cls)}
                bad = sorted(set(value) - section_fields)
                if bad:
                    raise ValueError(f"unknown field(s) in section {name!r}: {', '.join(bad)}")
                values[name] = section_cls(**value)
            else:
                values[name] = value
        return cls(**values)

    def save(self, path: str | Path) -> None:
        """Write as JSON atomically (temp file, fsync, rename)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        with tmp.open("w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=2, sort_keys=True)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"run config {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"run config {path} is not valid JSON: {exc}") from None
        return cls.from_dict(data)


RUN_FIELDS = ("num_learners", "inner_steps", "seed")


def add_run_config_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for every section (`--num-fragments`, `--min-quorum`, `--inner-lr`, `--model-width`, ...)
    and the run's own fields (`--learners`, `--inner-steps`, `--seed`)."""
    parser.add_argument("--learners", dest="num_learners", type=int, default=None,
                        help="M, learner processes (default: 4)")
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="inner steps per learner (default: 600)")
    parser.add_argument("--seed", type=int, default=None, help="global model init seed (default: 0)")
    for cls, prefix in SECTIONS.values():
        add_config_flags(parser, cls, prefix=prefix)


def run_config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """`base` (or the defaults) with every flag set on the command line applied on top."""
    base = base or RunConfig()
    values: dict[str, Any] = {}
    for name, (cls, prefix) in SECTIONS.items():
        current = getattr(base, name)
        overrides = {f.name: getattr(current, f.name) for f in dataclasses.fields(cls)}
        values[name] = config_from_args(cls, args, prefix=prefix, **{
            k: v for k, v in overrides.items() if getattr(args, prefix + k, None) is None})
    for name in RUN_FIELDS:
        flag = getattr(args, name, None)
        values[name] = getattr(base, name) if flag is None else flag
    return RunConfig(**values)
