"""The built-in learner: TinyGPT on the embedded Shakespeare corpus, an ordinary user of `ddiloco.session`.

`ddiloco run` without a script runs this module as every learner (`ddiloco learner` is the same loop with
flags), and once more as the evaluator. It is a plain PyTorch loop: build the model under the run's
seed (every learner starts alike; the first one's initialisation becomes the global model), take this
learner's data shard, and add one `sync.step(...)` per inner step. The run config's `model`, `data` and
`inner` sections describe this model; a user script ignores them.

    python -m ddiloco.train_tinygpt            # under `ddiloco run` (it reads the DDILOCO_* environment)
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

import ddiloco
from ddiloco.data import load_corpus, shard_stream, validation_batches
from ddiloco.environment import LearnerEnvironment, environment
from ddiloco.exit_status import RefusedError, UnreachableError
from ddiloco.model import build_model, estimate_loss
from ddiloco.run_config import RunConfig
from ddiloco.training import apply_inner_lr, inner_step, make_inner_optimizer

logger = logging.getLogger(__name__)

EVAL_BATCHES = 4
"""Validation batches per evaluation of the global model."""


def initial_params(config: RunConfig) -> dict[str, torch.Tensor]:
    """The genesis this learner proposes for a new run: TinyGPT under `torch.manual_seed(seed)` (the same in
    every process, so tests and replays can rebuild it)."""
    torch.manual_seed(config.seed)
    return {name: p.detach().clone() for name, p in build_model(config.model).named_parameters()}


def train(config: RunConfig, *, learner_id: int, device: str = "cpu", **session_options: Any) -> ddiloco.Session:
    """Train one learner until the run's inner-step budget is reached; returns the closed session."""
    torch.manual_seed(config.seed)
    model = build_model(config.model).to(device)
    optimizer = make_inner_optimizer(model, config.inner)
    data = shard_stream(load_corpus(), config.data, shard=learner_id, num_shards=config.num_learners)
    # Every batch holds exactly batch_size x context_len targets: the learner declares that, and no more.
    tokens_per_step = config.data.batch_size * config.data.context_len
    # Its model and data are the run config's: declared at join, so that a syncer whose run has other settings (a
    # learner started by hand without the run's config.json) refuses it rather than take its model as the run's.
    with ddiloco.session(model, optimizer, state={"data": data}, config=config, learner_id=learner_id,
                         max_tokens_per_step=tokens_per_step, declare_config=True, **session_options) as sync:
        while not sync.done:
            batch = data.next_batch()
            # From the session's step count, which a restart resumes: every rank of a group reads the same.
            apply_inner_lr(optimizer, config.inner, sync.inner_step, config.inner_steps)
            loss = inner_step(model, optimizer, batch, grad_clip=config.inner.grad_clip)
            sync.step(tokens=batch.tokens, loss=loss)
    return sync


def evaluate_global(config: RunConfig, *, device: str = "cpu", **watch_options: Any) -> None:
    """The evaluator: validation loss of the global model on the held-out tail, until the run ends."""
    model = build_model(config.model).to(device)
    batches = validation_batches(load_corpus(), config.data, num_batches=EVAL_BATCHES)
    ddiloco.watch(model, lambda m: {"val_loss": estimate_loss(m, batches)}, config=config, declare_config=True,
                  **watch_options)


def run_config_of(env: LearnerEnvironment) -> RunConfig:
    if env.config is not None:
        return RunConfig.load(env.config)
    if env.run_dir is not None and (env.run_dir / "config.json").is_file():
        return RunConfig.load(env.run_dir / "config.json")
    return RunConfig(num_learners=env.num_learners)


def main() -> int:
    env = environment()
    config = run_config_of(env)
    if env.threads:
        torch.set_num_threads(env.threads)
    if env.role == "evaluator":
        evaluate_global(config, device=env.device)
        return 0
    try:
        train(config, learner_id=env.learner_id, device=env.device)
    except (RefusedError, UnreachableError) as exc:
        print(f"ddiloco learner: {exc}", file=sys.stderr)
        return int(exc.code)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    sys.exit(main())
