"""Starting again where a learner's own training stopped being finite (`Learner.recover`): the inner optimizer's state
and the model's running statistics, which a NaN step leaves NaN for good (AdamW's moments feed every later step; an
average that holds a NaN never forgets it). The parameters come back from the global model, which is the learner
core's business."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def forget_non_finite_state(optimizer: torch.optim.Optimizer) -> int:
    """Drop the state of every parameter whose optimizer state holds a value that is not finite (AdamW's moments after
    a NaN gradient): the optimizer starts that parameter's state afresh at its next step. Returns how many. A sharded
    state (DTensor) is judged by this rank's shard."""
    dropped = [param for param, state in optimizer.state.items() if not all(_finite(v) for v in state.values())]
    for param in dropped:
        del optimizer.state[param]
    return len(dropped)


def optimizers_in(state: Any, *, leaving_out: torch.optim.Optimizer | None = None) -> list[torch.optim.Optimizer]:
    """Every `torch.optim.Optimizer` among a session's `state=` values, top-level or nested in dicts, lists and tuples,
    each once, in the order found, but `leaving_out` (the session's own optimizer): a GAN's second optimizer kept
    there must forget its non-finite state with the first (`Learner.recover`), or every later step is NaN again."""
    found: dict[int, torch.optim.Optimizer] = {}
    pending = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.optim.Optimizer):
            if value is not leaving_out:
                found.setdefault(id(value), value)
        elif isinstance(value, Mapping):
            pending.extend(reversed(list(value.values())))
        elif isinstance(value, list | tuple):
            pending.extend(reversed(value))
    return list(found.values())


def _finite(value: object) -> bool:
    """Whether an optimizer state entry is finite (anything that is not a floating-point tensor is)."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return True
    to_local = getattr(value, "to_local", None)  # a DTensor: this rank's shard
    return bool(torch.isfinite(to_local() if callable(to_local) else value).all())


def reset_non_finite_statistics(model: nn.Module) -> int:
    """Restart the running statistics (`reset_running_stats`: BatchNorm, InstanceNorm) of every module whose
    floating-point buffers are not finite. Returns how many."""
    restarted = 0
    for module in model.modules():
        reset = getattr(module, "reset_running_stats", None)
        buffers = [b for b in module.buffers(recurse=False) if b.is_floating_point()]
        if callable(reset) and any(not bool(torch.isfinite(b).all()) for b in buffers):
            reset()
            restarted += 1
    return restarted
