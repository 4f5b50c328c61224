"""The syncer's durable state: what survives `kill -9`, and how a restarted syncer gets it back.

Layout in the run directory:

    rounds.jsonl                          one committed round per line (RoundRecord.to_json())
    rounds/round_NNNNNN.safetensors       that round's merged pseudo-gradient
    checkpoints/syncer/state_NNNNNNNNN.*  full states: global parameters, outer momentum, versions,
                                          rounds committed, per-learner merged versions (+ counters)

Every round is made durable (its tensors, then its line, each fsynced) before the service sends its
result to any learner. A full state is written at start, every `full_state_every_rounds` rounds and
at a clean stop; it costs the whole model plus its momentum, so it is not written every round.
Restoring loads the newest full state and replays the rounds the log holds after it, through the
same outer optimizer (`replay_onto`), which reproduces the lost in-memory state bit for bit: no
committed round is lost, and none is applied twice because the log's round numbers must continue
exactly where the state ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddiloco.checkpoint import RoundLog, load_latest_state, save_state
from ddiloco.messages import RoundRecord
from ddiloco.model import build_model
from ddiloco.runtime.run_config import RunConfig
from ddiloco.syncer import Syncer

logger = logging.getLogger(__name__)

STATE_DIR = Path("checkpoints") / "syncer"


def initial_params(run_config: RunConfig) -> dict[str, torch.Tensor]:
    """The global model before any round: TinyGPT under `torch.manual_seed(seed)`, the same in every
    process (the syncer builds it; replay and tests rebuild it)."""
    torch.manual_seed(run_config.seed)
    model = build_model(run_config.model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def replay_onto(syncer: Syncer, records: Sequence[RoundRecord]) -> None:
    """Apply committed rounds to a syncer whose state ends right before the first of them."""
    syncer.apply_committed(records)


@dataclass
class Restored:
    """What `SyncerStore.restore` found."""

    state_rounds: int = 0
    """Rounds included in the full state that was loaded (0 without one)."""
    replayed: int = 0
    """Rounds replayed from the log on top of it."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The service counters saved with the state."""
    found_state: bool = False


class SyncerStore:
    """The round log and full states of one run directory. Used under the service's lock."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.log = RoundLog(self.run_dir)
        self.state_dir = self.run_dir / STATE_DIR

    def restore(self, syncer: Syncer) -> Restored:
        """Bring a freshly built syncer (initial parameters) to the last committed round."""
        self.log.repair()
        restored = Restored()
        latest = load_latest_state(self.state_dir)
        if latest is not None:
            state, meta, _ = latest
            syncer.load_state_dict(state)
            restored = Restored(state_rounds=syncer.rounds_committed, meta=meta, found_state=True)
        lines = len(self.log.lines())
        if lines < restored.state_rounds:
            raise ValueError(f"{self.log.path} holds {lines} rounds but the syncer state in {self.state_dir} "
                             f"has {restored.state_rounds}: the round log is damaged")
        records = list(self.log.records(start=restored.state_rounds))
        replay_onto(syncer, records)
        restored.replayed = len(records)
        return restored

    def commit(self, record: RoundRecord) -> None:
        """Make one round durable (returns after the fsyncs)."""
        self.log.append(record)

    def save(self, syncer: Syncer, meta: dict[str, Any]) -> None:
        """Write the full state (serial = rounds committed)."""
        save_state(self.state_dir, syncer.state_dict(), serial=syncer.rounds_committed, meta=meta)

    def participation(self) -> dict[int, dict[str, int]]:
        """Per learner, rounds it took part in and tokens merged, from the log."""
        out: dict[int, dict[str, int]] = {}
        for line in self.log.lines():
            for p in line["participants"]:
                tally = out.setdefault(int(p["learner_id"]), {"accepted": 0, "tokens_merged": 0})
                tally["accepted"] += 1
                tally["tokens_merged"] += int(p["tokens"])
        return out
