"""What `ddiloco run` refuses before it starts anything (`run_commands`): more learner processes than this machine's
memory holds, a built-in model that cannot be cut into the run's fragments, an `--init` file that is not the model's.
Each is a ValueError naming the problem and the flag that fixes it, raised while the run directory is still as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `ddiloco --help` builds the parsers without torch
    from ddiloco.run_config import RunConfig

PROCESS_MEMORY_FLOOR = 100 * 2**20
"""Bytes no learner process can do without: Python, torch and gRPC imported, before any model (a learner of a small
model holds about 250 MB resident, some of it shared). `ddiloco run` refuses, before it starts anything, more
processes on this machine than its available memory holds at this floor."""


def require_memory_for(processes: int, *, available: int | None = None) -> None:
    """A ValueError when `processes` learner processes cannot fit this machine's available memory (MemAvailable) at
    PROCESS_MEMORY_FLOOR each. `--learners 100000` forked learners until the kernel's OOM killer took the launcher
    itself, which left the syncer and the learners started so far running. Nothing is checked where the available
    memory is not known (not Linux)."""
    if available is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return
        fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        if "MemAvailable" not in fields:
            return
        available = int(fields["MemAvailable"].split()[0]) * 1024
    needed = processes * PROCESS_MEMORY_FLOOR
    if needed > available:
        raise ValueError(
            f"{processes} learner processes on this machine need at least {needed / 2**30:.0f} GiB"
            f" ({PROCESS_MEMORY_FLOOR // 2**20} MiB each before any model), and it has {available / 2**30:.1f} GiB "
            "available: run fewer (--learners, --nproc-per-learner, --standby-learners), or spread them over machines "
            "(--ray, docs/clusters.md)")


def check_built_in_fragments(config: RunConfig) -> None:
    """The built-in learner's model cut into the run's fragments as each learner cuts it: a cut it cannot make (more
    fragments than the model has tensors) is refused before anything starts, not at every learner's start."""
    import torch

    from ddiloco.fragments import FragmentPlan, embedding_names
    from ddiloco.model import build_model

    with torch.device("meta"):
        model = build_model(config.model)
    params = dict(model.named_parameters())
    embeddings = embedding_names(model, config.diloco.embedding_pattern)
    try:
        FragmentPlan.for_tensors(params, config.diloco, embeddings=embeddings)
    except ValueError as exc:
        raise ValueError(f"the built-in model cannot be cut so: {exc}") from None


def check_init(path: Path, config: RunConfig, *, built_in: bool, has_genesis: bool) -> None:
    """A ValueError unless the --init file is a readable safetensors file and, for the built-in learner of a run
    that has no genesis yet, holds TinyGPT's parameters and nothing else. A script's model is known only when its
    first learner joins, which the syncer then refuses naming the difference (`genesis_from_init`); a run that has
    its genesis ignores --init (the syncer says so)."""
    import torch

    from ddiloco.model import build_model
    from ddiloco.runtime.syncer_state import check_init_file

    if not built_in or has_genesis:
        check_init_file(path)
        return
    with torch.device("meta"):  # names and shapes only: no memory, no initialisation
        model = build_model(config.model)
    check_init_file(path, model)
