"""Shared test code: tiny models, synthetic data, and hand-rolled reference algorithms."""

from __future__ import annotations

import torch
from torch import nn

from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.learner import Learner
from ddiloco.syncer import Syncer
from ddiloco.transport.inprocess import InProcessHub


class TinyNet(nn.Module):
    """Embedding + two blocks + head: enough names for fragments, milliseconds per step."""

    def __init__(self, vocab: int = 16, width: int = 8, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.token_embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.lm_head = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        x = self.token_embedding(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.lm_head(x)


def make_batches(count: int, *, seed: int, batch: int = 4, length: int = 6, vocab: int = 16):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length + 1), generator=generator) for _ in range(count)]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> int:
    """One inner step on next-token prediction; returns the number of target tokens."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return targets.numel()


def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def make_system(num_learners: int, config: DilocoConfig, quorum: QuorumConfig | None = None, *,
                optimizer=sgd, syncer_seed: int = 100):
    """A syncer (initialised from its own seed) and `num_learners` joined learners on a virtual clock.

    Each learner's model is initialised from a different seed, so a test can tell whether a
    learner's own initialisation ever leaked into global state.
    """
    syncer = Syncer(config, quorum or QuorumConfig(), initial_params=params_of(TinyNet(seed=syncer_seed)))
    clock = VirtualClock()
    hub = InProcessHub(syncer, clock=clock)
    learners = []
    for learner_id in range(num_learners):
        model = TinyNet(seed=learner_id)
        learner = Learner(config, learner_id=learner_id, model=model, optimizer=optimizer(model))
        hub.join(learner)
        learners.append(learner)
    return syncer, hub, clock, learners
