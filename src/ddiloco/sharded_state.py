"""The optimizer state of sharded parameters (FSDP2's DTensors) as a learner's checkpoint keeps it: each rank's own
shard as plain tensors (`local_tensors`), turned back into DTensors of its parameter's layout once loaded
(`reshard_optimizer`), and how a checkpoint's state was split (`saved_optimizer_shards`). What a learner's ranks do
together is `ddiloco.learner_group`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def dtensor_type() -> type | None:
    """torch's DTensor class, or None in a torch without it (and so without FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def saved_optimizer_shards(ranks: list[Any] | None) -> int:
    """Into how many parts a checkpoint's optimizer state was split, from its `ranks` (`LearnerGroup.checkpoint`): one
    per rank where the followers saved shards of their own (sharded parameters), else 1 (rank 0's whole state)."""
    if ranks is not None and any(entry is not None and entry.get("optimizer") is not None for entry in ranks[1:]):
        return len(ranks)
    return 1


def local_tensors(state: Any) -> Any:
    """`state` with every DTensor replaced by this rank's shard (a plain tensor): picklable, and what this rank
    alone must keep of a sharded optimizer state."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(state, dtensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {key: local_tensors(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_tensors(value) for value in state)
    return state


def reshard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict` of `local_tensors` output: each state tensor of a DTensor parameter
    becomes a DTensor of that parameter's layout again (the optimizer step mixes it with DTensor gradients)."""
    dtensor = dtensor_type()
    if dtensor is None:
        return
    for param, state in optimizer.state.items():
        if not isinstance(param, dtensor):
            continue
        local_shape = param.to_local().shape
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.shape == local_shape:
                state[key] = dtensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
