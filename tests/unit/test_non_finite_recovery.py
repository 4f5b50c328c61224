"""A learner whose own model stops being finite (one NaN loss, an overflow) goes back to the global model and trains
on (`Learner.recover`). Before, its inner optimizer's state stayed NaN, every later step was NaN again and every
update was withheld: the learner trained to its budget and contributed nothing from then on."""

from __future__ import annotations

import logging

import torch
from torch import nn

import ddiloco
from ddiloco.non_finite import forget_non_finite_state, reset_non_finite_statistics
from tests.helpers import TinyNet, make_batches

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")
NAN_AT_STEP = 10


def train_two_learners(build, batch_loss, *, inner_steps=60):
    """Two learners in process, learner 0's loss NaN at one step; returns (hub, sessions, models)."""
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    models = [build(), build()]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    sessions = [ddiloco.session(model, optimizer, hub=hub, learner_id=i, inner_steps=inner_steps)
                for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True))]
    for sync in sessions:
        sync.start()
    batches = make_batches(8, seed=0)
    turn = 0
    while not all(sync.done for sync in sessions):
        for i, (sync, model, optimizer) in enumerate(zip(sessions, models, optimizers, strict=True)):
            if sync.done or not sync.ready:
                continue
            turn += 1
            loss = batch_loss(model, batches[turn % len(batches)])
            if i == 0 and sync.inner_step == NAN_AT_STEP:
                loss = loss * float("nan")  # one bad step: the gradients, the AdamW moments and the step all NaN
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=24)
    for sync in sessions:
        sync.close()
    return hub, sessions, models


def next_token_loss(model, batch):
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def test_a_learner_after_one_nan_step_goes_back_to_the_global_model_and_contributes_again(caplog):
    with caplog.at_level(logging.ERROR):
        hub, sessions, models = train_two_learners(lambda: TinyNet(seed=1), next_token_loss)
    stats = sessions[0].learner.stats
    assert stats.updates_withheld_non_finite == 1 and stats.non_finite_recoveries == 1
    assert "its model is not finite (a NaN loss, an overflow): fragments [0, 1] go back" in caplog.text
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())
    merged_at = [p.inner_step for r in hub.round_log for p in r.participants if p.learner_id == 0]
    assert max(merged_at) == 60 and len([s for s in merged_at if s > NAN_AT_STEP + 4]) >= 20


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        x = self.embed(idx)
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))


def test_running_statistics_that_went_nan_start_again():
    # A NaN forward leaves BatchNorm's running averages NaN for good (0.9 x NaN + 0.1 x batch is NaN).
    _, sessions, models = train_two_learners(NormNet, next_token_loss)
    assert sessions[0].learner.stats.non_finite_recoveries == 1
    norm = models[0].norm
    assert bool(torch.isfinite(norm.running_mean).all()) and bool(torch.isfinite(norm.running_var).all())


def test_only_state_that_is_not_finite_is_forgotten():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    optimizer.state[model[0].weight]["exp_avg_sq"][0, 0] = float("inf")
    assert forget_non_finite_state(optimizer) == 1
    assert model[0].weight not in optimizer.state and model[2].weight in optimizer.state
    assert reset_non_finite_statistics(model) == 0
    model[1].running_var[1] = float("nan")
    assert reset_non_finite_statistics(model) == 1 and torch.equal(model[1].running_var, torch.ones(2))
