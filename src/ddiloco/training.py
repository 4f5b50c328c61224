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

    lr: float = 3e-3
    """AdamW learning rate, reached after the warm-up. With the warm-up, TinyGPT's Decoupled learners over 896 steps
    tie from 3e-3 to 5e-3 and beat 2e-3 in the harness (on real processes they tie with it; 320-step runs end higher);
    data-parallel does best at 4e-3 (docs/results.md, "Defaults and rounds", item 15). 2e-3 was the best without a
    warm-up."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    """AdamW betas (0.95 for beta2 as usual in LM pre-training)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 45
    """Inner steps at the start of the run over which the learning rate climbs linearly to `lr`: step s (0-based)
    trains at `lr x (s + 1) / warmup_steps`; 0: none. Counted in steps, not as a share of the budget, so that a
    budget extended with `--resume` or an unbounded one (`ddiloco chaos`) warms up as any run does. Without it
    TinyGPT at 3e-3 stayed on its early plateau (docs/results.md, item 15)."""
    cooldown: float = 0.2
    """Share of the run's inner steps, at its end, over which the learning rate falls linearly from `lr` to 0 (a
    warm-up-stable-decay schedule; docs/results.md, "Defaults and rounds", item 12). 0 keeps it constant. Applied,
    with the warm-up, by the built-in loops (`ddiloco run`'s learner, the DDP baseline, the harness) from each one's
    own step count; a loop of your own keeps its own schedule."""

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
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise invalid("warmup_steps", self.warmup_steps, "an integer >= 0 (0: no warm-up)")
        if not 0 <= self.cooldown <= 1:
            raise invalid("cooldown", self.cooldown, "a share of the run's inner steps, 0 <= cooldown <= 1 (0: a "
                                                     "constant learning rate)")


def make_inner_optimizer(model: nn.Module, config: InnerConfig) -> torch.optim.Optimizer:
    """AdamW with `config`'s settings. Its groups carry `initial_lr`, as a torch scheduler's do: `apply_inner_lr` sets
    their rate each step, so a checkpoint's rate is the schedule's at its step, not a change a restore should warn of
    (`optimizer_restore`: every resume of the built-in learner said `lr 0.003 -> 0.00025`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(config.beta1, config.beta2))
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr
    return optimizer


def inner_lr(config: InnerConfig, step: float, total_steps: int) -> float:
    """The learning rate of inner step `step` (0-based, the steps taken before it) of a run of `total_steps`: climbing
    linearly over the first `warmup_steps`, then `lr`, then falling linearly over the last `cooldown` share of the
    steps, to `lr / (cooldown x total_steps)` at the last one (and at that rate past the end); where the two overlap
    (a run shorter than its warm-up and cooldown), the lower. A run whose budget `--resume` extends follows its new
    budget: the rate climbs back to `lr` if the new end is more than `cooldown` of it away."""
    rate = config.lr
    if step + 1 < config.warmup_steps:
        rate = config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.cooldown * total_steps
    left = total_steps - step
    if decay_steps > 0 and left < decay_steps:
        rate = min(rate, config.lr * max(left, 1) / decay_steps)
    return rate


def apply_inner_lr(optimizer: torch.optim.Optimizer, config: InnerConfig, step: float, total_steps: int) -> None:
    """Set every parameter group of an optimizer from `make_inner_optimizer` to `inner_lr(...)` for this step."""
    lr = inner_lr(config, step, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr


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
