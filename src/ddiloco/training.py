"""The inner step: the one piece of training code every ddiloco driver runs.

The simulator, the real learner process and the benchmarks all call `inner_step`, so there is only
one training loop body in the project. Users who bring their own loop do not need this module: they
call `Learner.after_inner_step(tokens)` after their own `optimizer.step()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.checks import invalid
from ddiloco.data import Batch


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    """The inner optimizer (AdamW) of every learner."""

    lr: float = 2e-3
    """AdamW learning rate (the best of 1e-3, 2e-3, 4e-3 for data-parallel TinyGPT at 4 x 8 sequences,
    docs/results.md)."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    """AdamW betas (0.95 for beta2 as usual in LM pre-training)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise invalid("lr", self.lr, "a finite number > 0")
        if self.weight_decay < 0:
            raise invalid("weight_decay", self.weight_decay, ">= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected 0 <= value < 1")
        if self.grad_clip < 0:
            raise invalid("grad_clip", self.grad_clip, ">= 0 (0 disables)")


def make_inner_optimizer(model: nn.Module, config: InnerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                             betas=(config.beta1, config.beta2))


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
               grad_clip: float = 0.0) -> float:
    """Forward, backward, (clip,) optimizer step on one batch; returns the loss."""
    device = next(model.parameters()).device
    _, loss = model(batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return float(loss.detach())
