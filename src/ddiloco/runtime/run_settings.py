"""The settings of `ddiloco run` itself: how it places, sizes and supervises the run's processes.

Each field is one `ddiloco run` flag (`ddiloco.flags`); what reaches a child goes on into that child's
settings file through `LaunchConfig` (`ddiloco.runtime.process_settings`). The run's algorithm config is
`RunConfig`, and the Ray placement `RayOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.checks import require_at_least, require_choice, require_int, require_positive
from ddiloco.flags import setting
from ddiloco.runtime.process_settings import (
    DEFAULT_CHECKPOINT_EVERY_S,
    DEFAULT_EVAL_EVERY_S,
    DEFAULT_FULL_STATE_EVERY,
    ROUND_FILES,
    require_address,
    require_devices,
)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """`ddiloco run`'s own settings (a run's paths, `--run-dir`, `--resume`, `--config`, are its own flags)."""

    link: str | None = setting(None, metavar="BANDWIDTH,LATENCY")
    """emulate this link for every learner, e.g. 2.5gbit,40ms"""
    threads: int | None = None
    """torch threads per learner (default: max(1, cores // learners))"""
    bind: str | None = setting(None, metavar="HOST:PORT")
    """where the syncer listens (default: 127.0.0.1:0, a free port)"""
    standby_learners: int = setting(0, metavar="N")
    """keep N warm learner processes (torch imported, waiting) so that a crashed learner is replaced without a cold
    start"""
    standby_syncer: bool = False
    """keep a standby syncer following the syncer's durable state; it takes over on the same address when the
    syncer dies, with no cold restart (costs one more process holding the global model and its momentum)"""
    device: str = setting("cpu", metavar="DEVICE[,DEVICE...]")
    """torch device of each learner, dealt round-robin: cpu, cuda, cuda:0,cuda:1"""
    nproc_per_learner: int = setting(1, metavar="N")
    """run each learner's script as N torch.distributed ranks with torchrun's environment (RANK, WORLD_SIZE,
    MASTER_PORT, ...; its own rendezvous), e.g. DDP or FSDP inside a learner; a rank that dies restarts its
    learner's ranks only"""
    evaluate: bool | None = None
    """also run an evaluator: the script with DDILOCO_ROLE=evaluator, which calls ddiloco.watch (default: on for
    the built-in learner, off for a script)"""
    eval_every_s: float = setting(DEFAULT_EVAL_EVERY_S, metavar="SECONDS")
    """seconds between two evaluations of the global model"""
    checkpoint_every_s: float = setting(DEFAULT_CHECKPOINT_EVERY_S, metavar="SECONDS")
    """period of each learner's local checkpoint: a kill -9 redoes at most this much"""
    init: str | None = setting(None, metavar="FILE.safetensors")
    """a new run's initial global parameters (default: the first learner's own)"""
    full_state_every: int = setting(DEFAULT_FULL_STATE_EVERY, metavar="ROUNDS")
    """the syncer writes its full state (global model, outer momentum and the int8 downlink's residual, 12 bytes a
    parameter) every this many rounds;
    a restart replays the rounds since, and rounds/ holds about twice as many rounds' files"""
    round_files: str = setting("recent", metavar="recent|all", choices=ROUND_FILES)
    """which rounds' merged tensors the syncer keeps in rounds/: recent (those a restart replays, after its older
    full state) or all (a replay from the genesis; rounds/ then grows by about 4 x parameters / H bytes per inner
    step); a --resume keeps the run's own"""
    built_in_learner: bool = False
    """run the built-in TinyGPT learner: on --resume, whatever learner command the run last ran with (without it or
    -- COMMAND, a --resume runs the run's own)"""

    def __post_init__(self) -> None:
        if self.threads is not None:
            require_int("threads", self.threads, minimum=1)
        require_int("standby_learners", self.standby_learners, minimum=0)
        require_int("nproc_per_learner", self.nproc_per_learner, minimum=1)
        require_devices("device", self.device)
        require_positive("checkpoint_every_s", self.checkpoint_every_s, "seconds")
        require_at_least("eval_every_s", self.eval_every_s, 0, "seconds")
        if self.bind is not None:
            require_address("bind", self.bind)
        require_int("full_state_every", self.full_state_every, minimum=1)
        require_choice("round_files", self.round_files, ROUND_FILES)

    @property
    def devices(self) -> tuple[str, ...]:
        """`--device cuda:0,cuda:1` as a tuple, dealt to the learners round-robin."""
        return tuple(d.strip() for d in self.device.split(","))
