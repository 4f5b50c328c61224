"""What the data-parallel agent (`data_parallel`) and its ranks (`dp_worker`) share: the job
directory's paths, the ranks' exit codes, and small pure helpers (the emulated all-reduce time, the
byte flip of a corrupt fault, seeds, parameter digests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ddiloco.checkpoint import atomic_write_json, read_json
from ddiloco.checks import require_int
from ddiloco.data_parallel import BITS_PER_BYTE, ring_allreduce_s
from ddiloco.fault_control import control_path

EXIT_OK = 0
EXIT_BAD_ARGS = 2
EXIT_DROPPED = 3
EXIT_NONFINITE = 4
EXIT_COLLECTIVE_FAILED = 5
EXIT_MEANINGS = {EXIT_BAD_ARGS: "bad arguments or config", EXIT_DROPPED: "a message of the all-reduce was dropped",
                 EXIT_NONFINITE: "non-finite loss or gradient",
                 EXIT_COLLECTIVE_FAILED: "a collective failed: a peer died or the gloo timeout fired"}
"""What each non-zero exit code of a rank means (the agent writes it into the failure's cause)."""
LOOPBACK = "127.0.0.1"
ALIVE_EVERY_S = 0.25
"""How often a rank's liveness thread touches `ranks/R/alive`: a rank that waits for a hung peer keeps touching
it, a stopped (SIGSTOP) or frozen process does not, so the agent can tell the two apart."""
PARTITION_POLL_S = 0.05
"""How often a partitioned rank looks whether the partition is over or it was asked to stop."""
_STATE_NAME = re.compile(r"^state_(\d+)\.json$")
"""The commit point of a `ddiloco.checkpoint.save_state` state: its JSON file, named by serial."""



# ---- the job directory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobPaths:
    """Where everything of one data-parallel job lives (the contract between the agent and its ranks)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def cursor(self, rank: int) -> Path:
        return self.checkpoints / "cursors" / f"{rank}.json"

    def rank_dir(self, rank: int) -> Path:
        return self.root / "ranks" / str(rank)

    def rank_alive(self, rank: int) -> Path:
        return self.rank_dir(rank) / "alive"

    def rank_status(self, rank: int) -> Path:
        return self.rank_dir(rank) / "status.json"

    def rank_metrics(self, rank: int) -> Path:
        return self.rank_dir(rank) / "metrics.jsonl"

    def control(self, rank: int) -> Path:
        return control_path(self.rank_dir(rank))


def committed_steps(checkpoint_dir: Path) -> list[int]:
    """Global steps of the durable checkpoints in `checkpoint_dir`, ascending."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for m in (_STATE_NAME.match(p.name) for p in checkpoint_dir.iterdir()) if m)


# ---- pure pieces ------------------------------------------------------------------------------------------


def emulated_allreduce_s(world_size: int, gradient_bytes: int, *, latency_s: float,
                         bytes_per_s: float | None) -> float:
    """Extra seconds a ring all-reduce (`ddiloco.data_parallel.ring_allreduce_s`) takes when one link has
    `latency_s` more latency and (if given) only `bytes_per_s` bandwidth: a ring moves at the pace of its
    slowest link."""
    bandwidth_bps = math.inf if bytes_per_s is None else bytes_per_s * BITS_PER_BYTE
    return ring_allreduce_s(world_size, gradient_bytes, latency_s=latency_s, bandwidth_bps=bandwidth_bps)


def flip_byte(flat: torch.Tensor, *, element: int, byte: int) -> None:
    """Invert every bit of byte `byte` of element `element` of a 1-D contiguous tensor, in place."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flip_byte needs a 1-D contiguous tensor, got shape {tuple(flat.shape)}")
    if not 0 <= element < flat.numel():
        raise ValueError(f"element={element} is out of range: the tensor has {flat.numel()} elements")
    if not 0 <= byte < flat.element_size():
        raise ValueError(f"byte={byte} is out of range: an element has {flat.element_size()} bytes")
    raw = flat.view(torch.uint8)
    index = element * flat.element_size() + byte
    raw[index] = raw[index] ^ 0xFF


def fault_seed(run_seed: int, rank: int, attempt: int, *, stream: int) -> int:
    """Seed of a rank's fault draws (stream 0: drop and corrupt draws, 1: which byte is corrupted): fixed by
    the run's seed, so a chaos run is repeatable, and new in every attempt, so a restart does not replay the
    draws that failed the previous one."""
    digest = hashlib.sha256(f"ddiloco-dp-faults:{run_seed}:{rank}:{attempt}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of one rank's gradient, i.e. of what DDP all-reduces every step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes in name order: equal digests mean bitwise-equal replicas."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """How one rank process runs (the training itself is in the job's RunConfig)."""

    job_dir: Path
    """The job directory (`JobPaths`)."""
    rank: int
    """torch.distributed rank, which is also its data shard."""
    attempt: int
    """The agent's attempt number (1, 2, ...), written into every metric line."""
    master_port: int
    """TCP port of the rendezvous store that rank 0 hosts on 127.0.0.1."""
    eval_every_s: float = 5.0
    """Rank 0 evaluates the validation loss this often (wall seconds of training) and at the end."""
    checkpoint_every_s: float = 20.0
    """Rank 0 asks for a checkpoint this often (wall seconds of training in this attempt)."""
    collective_timeout_s: float = 15.0
    """gloo's timeout on every collective: a peer silent this long fails the step."""
    start_timeout_s: float = 120.0
    """How long the rendezvous waits for every rank to arrive (torch import on a loaded machine is slow)."""
    eval_batches: int = 4
    """Validation batches per evaluation (the syncer's default, so both report the same loss)."""
    chaos_control: Path | None = None
    """The rank's control file, or None for no in-process faults."""
    threads: int = 1
    """torch threads of the rank process."""

    def save(self, path: Path) -> Path:
        """Write these settings for the rank process (`--settings FILE`), atomically."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        atomic_write_json(path, {k: str(v) if isinstance(v, Path) else v for k, v in values.items()})
        return path

    @classmethod
    def load(cls, path: Path) -> RankConfig:
        """The settings its agent wrote; ValueError naming the file when it is unreadable or not settings."""
        values = read_json(path)
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or not set(values) <= names:
            raise ValueError(f"settings file {path} is invalid: expected a JSON object with keys among "
                             + ", ".join(sorted(names)))
        for key in ("job_dir", "chaos_control"):
            if values.get(key) is not None:
                values[key] = Path(values[key])
        try:
            return cls(**values)
        except TypeError as exc:  # a required key missing
            raise ValueError(f"settings file {path} is invalid: {exc}") from None

    def __post_init__(self) -> None:
        require_int("threads", self.threads, minimum=1)
        if self.rank < 0:
            raise ValueError(f"rank={self.rank} is invalid: expected an integer >= 0")
        if self.attempt < 1:
            raise ValueError(f"attempt={self.attempt} is invalid: expected an integer >= 1")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} is invalid: expected a TCP port in 1..65535")
        for name in ("eval_every_s", "checkpoint_every_s", "collective_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number of seconds > 0")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches={self.eval_batches} is invalid: expected an integer >= 1")
