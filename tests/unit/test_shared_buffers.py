"""A buffer registered in two submodules (one running-statistics tensor that two layers read) is one tensor under two
state_dict keys. Like tied weights, it is kept, restored and exported under each of its names, and a restart keeps it
one tensor (`ddiloco.model_buffers`)."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file
from torch import nn

import ddiloco
from ddiloco.cli import main
from ddiloco.model_buffers import BUFFERS_FILE, load_buffers, persistent_buffers, snapshot_buffers, write_buffers
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_state import GenesisRecord, write_genesis

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")
SHARED = ("a.in_mean", "b.in_mean")
"""The two names of the one shared buffer."""


class SharedBuf(nn.Module):
    """Two linear layers that read one input-mean buffer, registered in each (a shared normaliser)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)
        stats = torch.zeros(4)
        self.a.register_buffer("in_mean", stats)
        self.b.register_buffer("in_mean", stats)

    def forward(self, x):  # (B, 4) -> (B, 1)
        if self.training:
            with torch.no_grad():
                self.a.in_mean.mul_(0.5).add_(0.5 * x.mean(0))
        return self.b(torch.tanh(self.a(x - self.a.in_mean)))


def train(model, run_dir, *, hub, inner_steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    with ddiloco.session(model, optimizer, hub=hub, learner_id=0, inner_steps=inner_steps, run_dir=run_dir) as sync:
        while not sync.done:
            x = 3.0 + torch.randn(8, 4, generator=generator)  # a mean far from the buffer's initial 0
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=8)
    return sync


def test_a_shared_buffer_is_a_persistent_buffer_under_each_of_its_names():
    model = SharedBuf()
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert set(persistent_buffers(model)) == set(model.state_dict()) - parameters == set(SHARED)
    assert set(snapshot_buffers(model)) == set(SHARED)


def test_a_restarted_learner_takes_a_shared_buffer_back_still_shared(tmp_path):
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    model = SharedBuf()
    sync = train(model, tmp_path, hub=hub, inner_steps=6)
    assert set(sync.learner.buffers) == set(SHARED)  # the join names both (an --init file may hold both)
    trained = model.a.in_mean.clone()
    assert not torch.allclose(trained, torch.zeros(4), atol=0.5)
    written = load_file(tmp_path / "learners" / "0" / BUFFERS_FILE)
    assert set(written) == set(SHARED) and all(torch.equal(written[name], trained) for name in SHARED)

    again = SharedBuf()  # a new process of learner 0, built with the buffer at 0
    assert train(again, tmp_path, hub=hub, inner_steps=6).inner_step == 6  # resumed, trained nothing more
    assert again.a.in_mean is again.b.in_mean  # restored in place: still one tensor
    assert torch.equal(again.a.in_mean, trained)


def test_an_export_holds_a_shared_buffer_under_each_name_and_loads_strictly(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_config = RunConfig()
    dataclasses.replace(run_config, diloco=dataclasses.replace(run_config.diloco, num_fragments=2)).save(
        run_dir / "config.json")
    model = SharedBuf()
    write_genesis(run_dir, GenesisRecord({n: p.detach().clone() for n, p in model.named_parameters()}, (), "a test"))
    for learner_id, mean in ((0, 1.0), (1, 3.0)):
        model.a.in_mean.fill_(mean)
        write_buffers(run_dir / "learners" / str(learner_id), snapshot_buffers(model))

    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    exported = load_file(out)
    fresh = SharedBuf()
    fresh.load_state_dict(exported)  # strict, as docs/your_model.md says
    assert all(torch.equal(exported[name], torch.full((4,), 2.0)) for name in SHARED)  # the mean over the learners
    assert fresh.a.in_mean is fresh.b.in_mean and torch.equal(fresh.b.in_mean, torch.full((4,), 2.0))


def test_a_shared_buffer_given_under_one_name_only_is_loaded_and_not_missing():
    # A checkpoint or learner file written before shared buffers were kept under each name holds the first one only.
    model = SharedBuf()
    assert load_buffers(model, {"a.in_mean": torch.full((4,), 5.0)}) == []
    assert model.a.in_mean is model.b.in_mean and torch.equal(model.b.in_mean, torch.full((4,), 5.0))
