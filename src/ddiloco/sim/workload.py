"""What a harness run trains: the model, the data, the inner optimizer, the token budget, the evaluation.

Owns the pieces every simulated system shares, so that Decoupled DiLoCo and the data-parallel
baselines see the same model, the same shards and the same validation batches: `WorkloadConfig`,
`seeded_model` (a TinyGPT built from a seed without touching torch's global generator) and
`Evaluator` (validation loss of a set of global parameters on fixed held-out batches).

The token budget is `num_learners * inner_steps * batch tokens`: learners stop once the budget is
spent, whoever spent it, so every system trains on the same number of tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ddiloco.data import DataConfig, load_corpus, validation_batches
from ddiloco.model import ModelConfig, TinyGPT, build_model, estimate_loss
from ddiloco.training import InnerConfig, apply_inner_lr


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """Model, data, inner optimizer, budget and evaluation of one simulated run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(batch_size=8))
    """Batch size per learner (or per data-parallel replica) and context length."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    inner_steps: int = 256
    """Inner steps per learner: the token budget is num_learners * inner_steps * batch tokens."""
    eval_points: int = 8
    """Validation-loss evaluations spread evenly over the token budget (plus one at the start)."""
    val_batches: int = 4
    """Held-out batches per evaluation (fixed: the same batches every time)."""

    def __post_init__(self) -> None:
        if self.data.context_len != self.model.context_len:
            raise ValueError(f"data.context_len={self.data.context_len} must equal "
                             f"model.context_len={self.model.context_len}")
        for name in ("inner_steps", "eval_points", "val_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")

    @property
    def tokens_per_step(self) -> int:
        """Target tokens of one learner's inner step (B * T)."""
        return self.data.batch_size * self.data.context_len

    def token_budget(self, num_learners: int) -> int:
        return num_learners * self.inner_steps * self.tokens_per_step

    def apply_lr(self, optimizer: torch.optim.Optimizer, *, spent_tokens: int, num_learners: int) -> None:
        """The inner learning rate of the next step (`ddiloco.training.inner_lr`), from the share of the token budget
        spent before it: every system of a run cools down over the same tokens, whoever spent them (a fast learner
        of a heterogeneous run does more than `inner_steps` steps)."""
        step = spent_tokens / (num_learners * self.tokens_per_step)
        apply_inner_lr(optimizer, self.inner, step, self.inner_steps)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def seeded_model(config: ModelConfig, seed: int) -> TinyGPT:
    """A TinyGPT initialised from `seed`; torch's global generator is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(config)


class Evaluator:
    """Validation loss of global parameters on the fixed held-out batches of the workload."""

    def __init__(self, workload: WorkloadConfig, *, corpus: bytes | None = None) -> None:
        corpus = load_corpus() if corpus is None else corpus
        self.batches = validation_batches(corpus, workload.data, num_batches=workload.val_batches)
        self._model = seeded_model(workload.model, 0)
        self._params = dict(self._model.named_parameters())

    @torch.no_grad()
    def loss(self, params: Mapping[str, torch.Tensor]) -> float:
        for name, param in self._params.items():
            param.copy_(params[name])
        return estimate_loss(self._model, self.batches)


def eval_schedule(budget_tokens: int, points: int) -> list[int]:
    """Token counts at which to evaluate: `points` evenly spaced marks up to the budget."""
    return [budget_tokens * (i + 1) // points for i in range(points)]
