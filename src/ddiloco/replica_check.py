"""The replicas of one learner's ranks compared: parameters that DDP keeps equal on every rank, found trained apart.

A learner of several ranks publishes rank 0's copy of a replicated parameter only (`ddiloco.learner_group`), so
replicas trained apart (a script without DDP or FSDP under `--nproc-per-learner`) would throw the other ranks' training
away at every sync while their tokens count. At the first publish of a fragment after its value was sent to every rank,
each rank fingerprints its replicas (evenly strided values, each parameter's sum and norm) and one small all-reduce
compares them; replicas that differ raise `ReplicasDivergedError` on every rank, naming the cause.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

REPLICA_SAMPLES = 1024
"""Values of a fragment compared across the ranks one by one (evenly strided over its parameters), besides each
parameter's sum and norm: a fingerprint of about 9 KB a rank in float64, reduced once per fragment."""
REPLICA_TOLERANCE = 1e-6
"""Relative difference between ranks' fingerprints that counts as replicas trained apart. Replicas that DDP keeps
equal are equal to the bit on one kind of device (the same gradients after the all-reduce, the same optimizer step);
this leaves about 8 float32 ulps for a reduction order that differs between devices. Replicas trained apart for the
inner steps of one period differ by a learning rate's step or more."""
REPLICA_TOLERANCE_ABS = 1e-12
"""Absolute slack beside `REPLICA_TOLERANCE`, for values at or near 0."""


class ReplicasDivergedError(RuntimeError):
    """The ranks of one learner hold different values of parameters that are meant to be replicas: they trained
    apart (no DistributedDataParallel or FSDP around the model). Raised on every rank at once."""


@torch.no_grad()
def check_replicas(params: Mapping[str, torch.Tensor], *, fragment: int, ranks: int, group: Any,
                   device: torch.device) -> None:
    """Collective: compare every rank's replica of `params` (fragment `fragment`'s replicated parameters), by one
    all-reduce (MAX) of each rank's fingerprint and its negation on `device`; raise `ReplicasDivergedError` on every
    rank when they differ. `ranks`: the learner's number of ranks, for the message."""
    names = list(params)
    total = sum(params[name].numel() for name in names)
    stride = max(1, total // REPLICA_SAMPLES)
    parts, sizes = [], []
    for name in names:
        flat = params[name].detach().reshape(-1)
        values = flat.float()
        summary = torch.stack([values.sum(), torch.linalg.vector_norm(values)]) if flat.numel() else values
        part = torch.cat([flat[::stride].to(torch.float64), summary.to(torch.float64)])
        parts.append(part.to(device))
        sizes.append(part.numel())
    fingerprint = torch.cat(parts)
    extremes = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    high, low = extremes[:fingerprint.numel()], -extremes[fingerprint.numel():]
    spread = (high - low).cpu()
    bound = (REPLICA_TOLERANCE * torch.maximum(high.abs(), low.abs()) + REPLICA_TOLERANCE_ABS).cpu()
    apart = spread > bound  # (NaN compares False: a non-finite replica is `Learner.recover`'s business)
    if not bool(apart.any()):
        return
    first = int(apart.nonzero()[0])
    offsets = torch.tensor(sizes).cumsum(0)
    name = names[int((offsets <= first).sum())]
    raise ReplicasDivergedError(
        f"the {ranks} ranks of this learner hold different values of parameter {name!r} (fragment "
        f"{fragment}: their sums, norms or sampled values differ by up to {float(spread.max()):.3g}, inner steps "
        "after rank 0's value was sent to every rank): they trained apart, and ddiloco publishes rank 0's copy "
        "only, so the other ranks' training would be thrown away at every sync while their tokens count. Wrap "
        "the model in DistributedDataParallel (or shard it with FSDP2's fully_shard) so that the ranks train one "
        "model together, or run one process per learner (no --nproc-per-learner; more --learners instead)")

