"""`InProcessHub.load_global(model)`: the trained global model out of a run in one process, in place, tied weights
tied, by the plain module's names; a model that is not the run's is refused naming what differs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddiloco

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


class Tied(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def trained_hub():
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))
    with ddiloco.session(model, optimizer, hub=hub, learner_id=0, inner_steps=12) as sync:
        while not sync.done:
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=tokens.numel())
    return hub


def test_the_global_model_is_copied_in_place_and_tied_weights_stay_one_tensor():
    hub = trained_hub()
    assert hub.syncer.rounds_committed >= 4
    model = Tied()
    wrapped = torch.compile(model)  # loaded by the plain module's names
    hub.load_global(wrapped)
    global_params = hub.syncer.global_params()
    assert set(global_params) == {name for name, _ in model.named_parameters()}
    assert all(torch.equal(p.detach(), global_params[name]) for name, p in model.named_parameters())
    assert model.head.weight is model.embed.weight
    assert not torch.equal(model.mid.weight, Tied().mid.weight)  # trained: not the initial value


def test_a_model_that_is_not_the_runs_is_refused_naming_the_difference():
    with pytest.raises(ValueError, match="no learner has joined this hub yet"):
        ddiloco.InProcessHub(config=CONFIG).load_global(Tied())
    hub = trained_hub()
    with pytest.raises(ValueError, match=r"parameter 'embed.weight' has shape \(10, 8\), the run's \(10, 6\)"):
        hub.load_global(Tied(width=8))
    other = Tied()
    other.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"parameter 'extra.bias' is not in the run's model \(2 differences in all\)"):
        hub.load_global(other)
