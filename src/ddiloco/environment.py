"""The environment `ddiloco run` sets for each learner script: its place in the run.

`ddiloco.environment()` reads the `DDILOCO_*` variables (docs/your_model.md lists them); the launcher
(`ddiloco.runtime.launcher.Launcher.learner_env`) writes them. Like torchrun's RANK and WORLD_SIZE, they
are how a script started by the launcher learns who it is; a script started by hand can set them, or
pass the same facts to `ddiloco.session(...)` as keywords. It also reads torchrun's `RANK`, `WORLD_SIZE`
and `LOCAL_RANK` (a learner of several ranks). This module is the one place of the library that reads
them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "DDILOCO_"
"""`ddiloco run` describes each learner's place in the run in these environment variables."""

@dataclass(frozen=True, kw_only=True)
class LearnerEnvironment:
    """This process's place in a run, as `ddiloco run` (or the user) describes it."""

    learner_id: int = 0
    num_learners: int = 1
    device: str = "cpu"
    """torch device this learner should put its model on (`ddiloco run --device`)."""
    role: str = "learner"
    """learner, or evaluator (`ddiloco run --evaluate`: a read-only copy of the script; see `ddiloco.watch`)."""
    seed: int = 0
    """The run's seed: build the model under `torch.manual_seed(seed)` so every learner starts alike."""
    syncer: str | None = None
    run_dir: Path | None = None
    token_file: Path | None = None
    config: Path | None = None
    """The run's config.json."""
    link: str | None = None
    """BANDWIDTH,LATENCY of an emulated link to the syncer."""
    chaos_control: Path | None = None
    threads: int | None = None
    eval_every_s: float = 10.0
    """An evaluator's period (`ddiloco run --eval-every-s`)."""
    checkpoint_every_s: float = 10.0
    """The period of the learner's local checkpoints (`ddiloco run --checkpoint-every-s`)."""
    rank: int = 0
    """This process's torch.distributed rank within its learner (torchrun's RANK; 0 for a one-process learner)."""
    world_size: int = 1
    """The learner's ranks (torchrun's WORLD_SIZE; `ddiloco run --nproc-per-learner`)."""
    local_rank: int = 0
    """torchrun's LOCAL_RANK: this rank's index on its machine (which GPU it takes)."""
    launcher_pid: int | None = None
    """The process that started this one (`ddiloco run`, or its Ray actor), which a session watches: once it is gone
    the session stops as on SIGTERM (`ddiloco.launcher_watch`). None: not started by a launcher."""
    launcher_started: int | None = None
    """That process's start time (`launcher_watch.process_start_time`), so that a reused pid does not count."""
    rank_failures: Path | None = None
    """Where this rank's session records an exception that left it (`ddiloco.rank_failures`): set by the rank group
    of a learner of several ranks (`ddiloco run --nproc-per-learner`)."""

    @property
    def launcher(self) -> tuple[int, int] | None:
        """(pid, start time) of the launcher to watch, or None."""
        if self.launcher_pid is None or self.launcher_started is None:
            return None
        return self.launcher_pid, self.launcher_started

    @property
    def managed(self) -> bool:
        """True when this process was started by `ddiloco run` (or told where its syncer is)."""
        return self.syncer is not None


def environment(environ: Mapping[str, str] | None = None) -> LearnerEnvironment:
    """Read the `DDILOCO_*` variables (`ddiloco run` sets them; docs/your_model.md lists them). Outside a
    run: learner 0 of 1, cpu, no syncer."""
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        value = env.get(ENV_PREFIX + name)
        return value if value else None

    def number(name: str, default: int, *, prefix: str = ENV_PREFIX) -> int:
        value = env.get(prefix + name) or None
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{prefix}{name}={value!r} is invalid: expected an integer") from None

    def path(name: str) -> Path | None:
        value = get(name)
        return Path(value) if value is not None else None

    def seconds(name: str, default: float, *, zero: bool) -> float:
        value = get(name)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and (number >= 0 if zero else number > 0)):
            raise ValueError(f"{ENV_PREFIX}{name}={value!r} is invalid: expected a number of seconds "
                             f"{'>= 0' if zero else '> 0'}")
        return number

    found = LearnerEnvironment(
        learner_id=number("LEARNER_ID", 0), num_learners=number("NUM_LEARNERS", 1), device=get("DEVICE") or "cpu",
        role=get("ROLE") or "learner", seed=number("SEED", 0), syncer=get("SYNCER"), run_dir=path("RUN_DIR"),
        token_file=path("TOKEN_FILE"), config=path("CONFIG"), link=get("LINK"),
        chaos_control=path("CHAOS_CONTROL"), threads=number("THREADS", 0) or None,
        eval_every_s=seconds("EVAL_EVERY_S", 10.0, zero=True),
        checkpoint_every_s=seconds("CHECKPOINT_EVERY_S", 10.0, zero=False),
        rank=number("RANK", 0, prefix=""), world_size=number("WORLD_SIZE", 1, prefix=""),
        local_rank=number("LOCAL_RANK", 0, prefix=""), launcher_pid=number("LAUNCHER_PID", 0) or None,
        launcher_started=number("LAUNCHER_STARTED", 0) or None, rank_failures=path("RANK_FAILURES"))
    if found.threads is not None and found.threads < 1:
        raise ValueError(f"{ENV_PREFIX}THREADS={found.threads} is invalid: expected an integer >= 1 (torch threads)")
    if not 0 <= found.learner_id < found.num_learners:
        raise ValueError(f"{ENV_PREFIX}LEARNER_ID={found.learner_id} is invalid: the run has {found.num_learners} "
                         f"learners (ids 0..{found.num_learners - 1})")
    if get("NUM_LEARNERS") is not None:
        _check_run_learners(found)
    if not 0 <= found.rank < found.world_size:
        raise ValueError(f"RANK={found.rank} is invalid with WORLD_SIZE={found.world_size}: expected 0..WORLD_SIZE-1")
    if found.role not in ("learner", "evaluator"):
        raise ValueError(f"{ENV_PREFIX}ROLE={found.role!r} is invalid: expected learner or evaluator")
    return found


def _check_run_learners(found: LearnerEnvironment) -> None:
    """ValueError when `DDILOCO_NUM_LEARNERS` differs from M in the run's config.json (`DDILOCO_CONFIG`, else
    `DDILOCO_RUN_DIR/config.json`): a script that shards its data by `environment().num_learners` would skip shards
    (4 of a 2-learner run: half the data) or share them, and no other check would see it. Checked here, where every
    script asks for its place in the run before it reads data. Only M is read, as plain JSON: a missing or damaged
    file is left to `ddiloco.session`, which loads and checks the whole config."""
    path = found.config or (found.run_dir / "config.json" if found.run_dir is not None else None)
    if path is None:
        return
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    learners = run.get("num_learners") if isinstance(run, dict) else None
    if isinstance(learners, int) and learners != found.num_learners:
        raise ValueError(f"{ENV_PREFIX}NUM_LEARNERS={found.num_learners} differs from the run's {path}, which says "
                         f"num_learners {learners}: data sharded by environment().num_learners would not match the "
                         f"run's learners; set {ENV_PREFIX}NUM_LEARNERS={learners}")
