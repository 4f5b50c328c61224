"""The bytes one of ddiloco's own runs moves, per learner and direction, predicted from its config.

The same accounting as `ddiloco.plan.bandwidth`, made exact for ddiloco's protocol so that it can be
checked against a run's metrics (`Learner.stats.bytes_sent` / `bytes_received`, `Syncer.bytes_sent`
/ `bytes_received`):

- uplink: every round a learner publishes (round r is due at inner step `fragments.due_step(r)`,
  fragment r mod P) carries each tensor of that fragment encoded separately by the codec, so the
  codec's per-tensor and per-block scales count (`ddiloco.compression`'s `encoded_nbytes`);
- downlink: a join brings the whole model as float32 (4 B/value); every committed round sends the
  merged fragment to every learner alive, encoded per tensor by the downlink codec (float32 for fp32, the
  fragment's change for int8 / int4: `ddiloco.downlink`);
- the end (`Learner.flush`): each fragment trained since its last round is published once more, so
  the final global model holds every learner's last steps (`flush_sent`); learners finish at different
  moments, so each one's flush may make rounds of its own, and their merged results reach a learner only
  if they arrive before it leaves: at most one per learner and flushed fragment (`flush_received_max`);
- the genesis: the first learner of a new run uploads its whole model once as float32 (`genesis_sent`).

Assumed, as in a lockstep run: every learner runs the same inner steps, every round commits once and
reaches every learner, and no update is rejected as stale (a rejection adds one fragment download).
Decoupled DiLoCo: Douillard et al., arXiv 2604.21428.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ddiloco.compression import get_codec
from ddiloco.config import DEFAULT_DOWNLINK_CODEC, DilocoConfig
from ddiloco.fragments import FragmentPlan, due_step

JOIN_BYTES_PER_VALUE = 4
"""The join's model (a Welcome) and the genesis travel as float32 (messages.FragmentState)."""


@dataclass(frozen=True)
class RunBytes:
    """Predicted payload bytes, message framing excluded: as the syncer counts (`Syncer.bytes_sent`, in process and
    over gRPC). A learner over gRPC counts its whole serialised messages, framing included: about 1 % more than this
    (0.6 % in a 2-learner TinyGPT run), and its `bytes_sent` holds the genesis when it proposed it."""

    rounds_per_learner: int
    """Rounds each learner published (= rounds committed, in a lockstep run)."""
    learner_sent: int
    """Per learner, uplink: encoded pseudo-gradients."""
    learner_received: int
    """Per learner, downlink: the join's model plus one merged fragment (or its change) per round."""
    syncer_received: int
    syncer_sent: int
    flush_sent: int = 0
    """Per learner, the final flush's uplink (included in learner_sent and syncer_received)."""
    flush_received_max: int = 0
    """Per learner, the most the flush rounds' downlink can add to learner_received (a race with leaving):
    one merged fragment per learner and flushed fragment."""
    genesis_sent: int = 0
    """Uplink of the one learner whose initial parameters became the run's genesis (not in learner_sent)."""


def rounds_due(inner_steps: int, sync_every: int, num_fragments: int) -> int:
    """Rounds whose due inner step is at most `inner_steps` (none before the first inner step)."""
    if inner_steps <= 0:
        return 0
    periods = inner_steps // sync_every
    count = periods * num_fragments
    # Rounds of the unfinished period: at most P more, in due order.
    while count < (periods + 1) * num_fragments and due_step(count, sync_every, num_fragments) <= inner_steps:
        count += 1
    return count


def even_fragments(num_params: int, num_fragments: int) -> list[list[int]]:
    """A model of `num_params` values cut into P single-tensor fragments of nearly equal size."""
    if num_params < num_fragments:
        raise ValueError(f"num_params={num_params} is invalid: expected at least num_fragments={num_fragments}")
    base, extra = divmod(num_params, num_fragments)
    return [[base + (1 if p < extra else 0)] for p in range(num_fragments)]


def fragment_numels(named_params: Mapping[str, torch.Tensor], config: DilocoConfig) -> list[list[int]]:
    """Tensor sizes per fragment of a real model, cut exactly as learners and syncer cut it."""
    plan = FragmentPlan.for_tensors(named_params, config)
    return [[named_params[name].numel() for name in names] for names in plan.fragments]


def flushed_fragments(inner_steps: int, sync_every: int, num_fragments: int) -> list[int]:
    """Fragments the final flush publishes: those trained after their last round. A fragment whose round
    fell due at the very last inner step is still waiting for that round's result and is not flushed."""
    rounds = rounds_due(inner_steps, sync_every, num_fragments)
    last_due = {r % num_fragments: due_step(r, sync_every, num_fragments) for r in range(rounds)}
    return [p for p in range(num_fragments) if last_due.get(p, 0) < inner_steps] if inner_steps > 0 else []


def predict_run_bytes(*, fragment_numels: Sequence[Sequence[int]], codec: str, sync_every: int, inner_steps: int,
                      learners: int, downlink_codec: str = DEFAULT_DOWNLINK_CODEC, joins_per_learner: int = 1,
                      final_flush: bool = True) -> RunBytes:
    """Bytes per learner and direction, and at the syncer, for `inner_steps` inner steps of every learner.

    `fragment_numels[p]` lists the element counts of fragment p's tensors (P = its length); use
    `even_fragments` when only the parameter count is known, `fragment_numels` for a real model.
    """
    num_fragments = len(fragment_numels)
    for name, value, low in (("num_fragments", num_fragments, 1), ("sync_every", sync_every, 1),
                             ("inner_steps", inner_steps, 0), ("learners", learners, 1),
                             ("joins_per_learner", joins_per_learner, 0)):
        if value < low:
            raise ValueError(f"{name}={value} is invalid: expected >= {low}")
    encoder = get_codec(codec)
    up = [sum(encoder.encoded_nbytes(n) for n in tensors) for tensors in fragment_numels]
    round_encoder = get_codec(downlink_codec)
    down = [sum(round_encoder.encoded_nbytes(n) for n in tensors) for tensors in fragment_numels]
    join = JOIN_BYTES_PER_VALUE * sum(sum(tensors) for tensors in fragment_numels)
    rounds = rounds_due(inner_steps, sync_every, num_fragments)
    cycles, partial = divmod(rounds, num_fragments)  # round r syncs fragment r mod P
    flushed = flushed_fragments(inner_steps, sync_every, num_fragments) if final_flush else []
    flush_sent = sum(up[p] for p in flushed)
    sent = cycles * sum(up) + sum(up[:partial]) + flush_sent
    received = joins_per_learner * join + cycles * sum(down) + sum(down[:partial])
    return RunBytes(rounds, sent, received, learners * sent, learners * received, flush_sent=flush_sent,
                    flush_received_max=learners * sum(down[p] for p in flushed), genesis_sent=join)
