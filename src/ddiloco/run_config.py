"""The resolved configuration of a whole run: every component's config plus the run's own fields.

One JSON file (`config.json` in the run directory) holds it, so the syncer, every learner process and
a later `--resume` read exactly the same settings. Cross-field checks live here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco import __version__
from ddiloco.checks import require
from ddiloco.config import FIELDS_ADDED, DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.data import VOCAB_SIZE, DataConfig
from ddiloco.flags import add_config_flags, as_flag_error, config_from_args, flag_of, setting
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
MAX_SEED = 2**63 - 1
"""The largest run seed. `torch.manual_seed` takes at most 2**64 - 1 (past it every learner failed with "Overflow
when unpacking long long"); keeping the seed below 2**63 leaves room for the seeds a script derives from it
(seed + learner_id, + a stride per restart), and matches the data's generator seeds (`ddiloco.data`)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a run needs besides addresses and paths."""

    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    num_learners: int = setting(4, flag="--learners", metavar="M")
    """M: learner processes in the run."""
    inner_steps: int = setting(600, metavar="STEPS")
    """Inner steps each learner trains before it leaves."""
    seed: int = 0
    """Seed of the global model's initialisation (done once, by the syncer)."""

    def __post_init__(self) -> None:
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= MAX_SEED,
                "seed", self.seed, f"an integer in 0..{MAX_SEED} (2**63 - 1)")
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
        """The config a JSON object describes. Every value is type-checked here, against the field's annotation,
        so a user's `"lr": "1e-3"` is refused by name instead of failing somewhere in a `__post_init__`."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object ({{\"inner\": {{\"lr\": 0.001}}, ...}}), got {_json(data)}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown run config field(s): {', '.join(unknown)} ({NOT_THIS_VERSIONS})")
        values: dict[str, Any] = {}
        run_types = typing.get_type_hints(cls)
        for name, value in data.items():
            if name in SECTIONS:
                if not isinstance(value, dict):
                    raise ValueError(f"{name} = {_json(value)} is invalid: expected a JSON object (the {name} section)")
                section_cls = SECTIONS[name][0]
                value = _saved_before_its_new_field(name, value)
                section_types = typing.get_type_hints(section_cls)
                bad = sorted(set(value) - {f.name for f in dataclasses.fields(section_cls)})
                if bad:
                    raise ValueError(f"unknown field(s) in section {name!r}: {', '.join(bad)} ({NOT_THIS_VERSIONS})")
                values[name] = section_cls(**{key: typed_value(f"{name}.{key}", item, section_types[key])
                                              for key, item in value.items()})
            else:
                values[name] = typed_value(name, value, run_types[name])
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
        """Read and check a config file; every problem is a `ValueError` that names the file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"run config {path} does not exist") from None
        except IsADirectoryError:
            raise ValueError(f"run config {path} is a directory, not a JSON file") from None
        except UnicodeDecodeError:
            raise ValueError(f"run config {path} is not UTF-8 text: is it a config.json?") from None
        except OSError as exc:
            raise ValueError(f"run config {path} cannot be read: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"run config {path} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"run config {path}: {exc}") from None


NOT_THIS_VERSIONS = (f"ddiloco {__version__} has no such field: a misspelt name, or a config written by a newer "
                     "ddiloco, which this one cannot run; `ddiloco --version` shows each one's")
"""Why a config names a field this version does not know (an upgrade probe: the message named the field alone)."""

_BEFORE_COOLDOWN = frozenset({"lr", "weight_decay", "beta1", "beta2", "grad_clip"})
_QUORUM_BEFORE_FLOOR = frozenset({"min_quorum", "grace", "grace_s", "grace_gamma", "grace_max_steps", "estimate_decay",
                                  "max_staleness", "heartbeat_timeout_s", "max_tokens_per_step", "staleness_discount",
                                  "max_weight_ratio"})
_DILOCO_BEFORE_MARGINS = frozenset({"codec", "downlink_codec", "embedding_pattern", "fragment_strategy",
                                    "keep_overlap_work", "merge", "num_fragments", "outer_lr", "outer_momentum",
                                    "overlap_steps", "pace_rounds", "sync_every"})
_SAVED_BEFORE: dict[str, tuple[tuple[frozenset[str], dict[str, Any]], ...]] = {
    "diloco": ((_DILOCO_BEFORE_MARGINS, dict(FIELDS_ADDED)),
               (_DILOCO_BEFORE_MARGINS | {"round_margin_steps"}, dict(FIELDS_ADDED[1:]))),
    "data": ((frozenset({"batch_size", "context_len", "val_fraction", "seed"}), {"shard_layout": "contiguous"}),),
    "inner": ((_BEFORE_COOLDOWN, {"cooldown": 0.0, "warmup_steps": 0}),
              (_BEFORE_COOLDOWN | {"cooldown"}, {"warmup_steps": 0})),
    "quorum": ((_QUORUM_BEFORE_FLOOR, {"grace_min_steps": 0.0, "max_norm_ratio": 0.0, "progress_timeout_s": 0.0}),
               (_QUORUM_BEFORE_FLOOR | {"grace_min_steps"}, {"max_norm_ratio": 0.0, "progress_timeout_s": 0.0}),
               (_QUORUM_BEFORE_FLOOR | {"grace_min_steps", "max_norm_ratio"}, {"progress_timeout_s": 0.0})),
}
"""Section -> for each generation of it: every field it had then, and the fields added since with a new default, at
the values runs of then trained with. The diloco section before the round margins (none; 1.5 steps since 2026-12-02)
and their drift (`config.FIELDS_ADDED`, whose fingerprints a syncer state of then holds); the data one before the
shard layouts (contiguous shards; whole since 2026-12-04); the inner one before the learning-rate cooldown (a constant
rate; 0.2 of the run since 2026-12-04) and before the warm-up (none; 45 steps since 2026-12-05); the quorum one before
the grace window's floor (none; a quarter step since 2026-12-05, later that day) and before the cap on an update's norm
(none; 10 times the fragment's previous round since 2026-12-05, a session later) and before the bound on a live learner
without updates (none; since 2026-12-07)."""


def _saved_before_its_new_field(name: str, section: dict[str, Any]) -> dict[str, Any]:
    """A section as a run saved it before its newest fields existed (every field of then, none of the new ones)
    resumes with what that run trained with, not today's defaults. A section that names only some fields, a user's,
    takes today's defaults for the rest."""
    for fields_then, values_then in _SAVED_BEFORE.get(name, ()):
        if set(section) == fields_then:
            return {**section, **values_then}
    return section


_JSON_TYPES: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"),
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
}
"""A field's annotation -> the JSON values it accepts, and how to say so. bool is an int subclass in Python,
so it is refused explicitly wherever a number is expected."""


def _json(value: Any) -> str:
    """`value` as it was written in the JSON file (a string in quotes, null, true)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _fits(value: Any, annotation: Any) -> bool:
    accepted, _ = _JSON_TYPES[annotation]
    return isinstance(value, accepted) and (annotation is bool or not isinstance(value, bool))


def typed_value(name: str, value: Any, annotation: Any) -> Any:
    """`value` if it is a JSON value of the field's type, else a ValueError naming the field, the expected type
    and the value. An integer for a float field stays as written: every process that reads the same file then
    computes the same `DilocoConfig.fingerprint()`, as every process always has."""
    if annotation not in _JSON_TYPES or _fits(value, annotation):
        return value  # (a field that is not a scalar is judged by its own __post_init__)
    hint = ""
    if isinstance(value, str) and annotation is not str:
        with contextlib.suppress(json.JSONDecodeError):
            if _fits(json.loads(value), annotation):
                hint = " (write it without quotes)"
    raise ValueError(f"{name} = {_json(value)} is invalid: expected {_JSON_TYPES[annotation][1]}{hint}")


RUN_FIELDS = ("num_learners", "inner_steps", "seed")
"""The run's own fields (not a section's)."""
RESUMABLE = ("inner_steps", "quorum", "learner")
"""What `--resume` may change: the inner-step budget (to extend a run), the syncer's quorum policy and the
learners' waiting policy, which act afresh from the next round on. Everything else is what the run's existing
state was made with: M (the data shards and learner ids), the seed, the algorithm the rounds were merged with,
the model and data shapes, and the inner optimizer (restored from each learner's checkpoint, so a new value
would be silently overridden)."""


def flag_name(section: str | None, name: str) -> str:
    """The command-line flag of a run config field (`--learners`, `--inner-lr`, `--min-quorum`)."""
    if section is None:
        return flag_of(_RUN_FIELD[name])
    return "--" + (SECTIONS[section][1] + name).replace("_", "-")


_RUN_FIELD = {f.name: f for f in dataclasses.fields(RunConfig)}


def fixed_differences(saved: RunConfig, wanted: RunConfig, *, sections: tuple[str, ...] | None = None) -> list[str]:
    """Every setting of `wanted` that differs from the run's own (`saved`) but cannot change for an existing run
    (see RESUMABLE), as its flag with both values: `--model-width 64 (the run has 32)`. `sections`: only the
    settings of these sections (of every section and the run's own fields when None)."""
    changed = [(None, name, getattr(saved, name), getattr(wanted, name))
               for name in RUN_FIELDS if name not in RESUMABLE and sections is None]
    for section, (cls, _) in SECTIONS.items():
        if section not in RESUMABLE and (sections is None or section in sections):
            changed += [(section, f.name, getattr(getattr(saved, section), f.name),
                         getattr(getattr(wanted, section), f.name)) for f in dataclasses.fields(cls)]
    return [f"{flag_name(section, name)} {_shown(new)} (the run has {_shown(old)})"
            for section, name, old, new in changed if old != new]


def check_resume(saved: RunConfig, wanted: RunConfig) -> None:
    """ValueError naming every setting that differs from the run's own (`saved`) but cannot change for an
    existing run (`fixed_differences`), with both values."""
    refused = fixed_differences(saved, wanted)
    if refused:
        raise ValueError(f"an existing run cannot change {', '.join(refused)}; only --inner-steps and the quorum and "
                         "learner settings (--min-quorum, --grace, --max-wait-s, ...) may change on --resume")


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) and (not value or " " in value) else str(value)


def add_run_config_flags(parser: argparse.ArgumentParser, *, sections: tuple[str, ...] = tuple(SECTIONS),
                         run_fields: tuple[str, ...] = RUN_FIELDS) -> None:
    """Flags for the run's own fields (`--learners`, `--inner-steps`, `--seed`) and for every field of the named
    sections (`--num-fragments`, `--min-quorum`, `--inner-lr`, `--model-width`, ...): a command shows the settings
    it uses (`ddiloco learner` has no quorum flags: that policy is the syncer's)."""
    if run_fields:
        add_config_flags(parser, RunConfig, only=run_fields, title="run")
    for name in sections:
        cls, prefix = SECTIONS[name]
        add_config_flags(parser, cls, prefix=prefix)


def run_config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """`base` (or the defaults) with every flag set on the command line applied on top. A value a config refuses is
    named by its flag (`--learners=0 is invalid: ...`, not `num_learners=0`)."""
    base = base or RunConfig()
    values: dict[str, Any] = {}
    for name, (cls, prefix) in SECTIONS.items():
        current = getattr(base, name)
        overrides = {f.name: getattr(current, f.name) for f in dataclasses.fields(cls)}
        try:
            values[name] = config_from_args(cls, args, prefix=prefix, **{
                k: v for k, v in overrides.items() if getattr(args, prefix + k, None) is None})
        except ValueError as exc:
            raise as_flag_error(exc, cls, prefix=prefix) from None
    for name in RUN_FIELDS:
        flag = getattr(args, name, None)
        values[name] = getattr(base, name) if flag is None else flag
    try:
        config = RunConfig(**values)
    except ValueError as exc:
        raise as_flag_error(exc, RunConfig) from None
    _refuse_flags_without_effect(args, config)
    return config


def _refuse_flags_without_effect(args: argparse.Namespace, config: RunConfig) -> None:
    """Flags a run would take and do nothing with (a typo, most likely), refused naming what they would need. Only
    flags given on this command line: a config file that holds such a value (a window of a fixed run later made
    adaptive) is left as it is."""
    quorum = config.quorum
    if getattr(args, "grace_s", None) is not None and quorum.grace != "fixed":
        raise ValueError(f"--grace-s {args.grace_s} applies only with --grace fixed (this run's window is "
                         f"{quorum.grace}): give --grace fixed too, or leave --grace-s out")
    given = getattr(args, "min_quorum", None) is not None or getattr(args, "num_learners", None) is not None
    if given and quorum.min_quorum > config.num_learners:
        raise ValueError(f"--min-quorum {quorum.min_quorum} is more than the run's {config.num_learners} learners: "
                         f"a round can wait for {config.num_learners} at most (--min-quorum {config.num_learners} "
                         "makes every round wait for every learner alive)")
