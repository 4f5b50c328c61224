"""A model wrapped in `nn.DataParallel` is synced, checkpointed and exported under its plain module's names, as one in
DistributedDataParallel or `torch.compile` is (`learner_group.unwrap`): with the wrapper's `module.` prefix its export
did not load into the plain model, and a DataParallel learner and a plain one did not share names."""

from __future__ import annotations

import torch
from torch import nn

import ddiloco
from ddiloco.learner_group import unwrap
from ddiloco.model_buffers import persistent_buffers
from tests.helpers import TinyNet, make_batches, train_step

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def test_unwrap_takes_the_module_out_of_data_parallel():
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert unwrap(nn.DataParallel(plain)) is plain
    assert list(persistent_buffers(nn.DataParallel(plain))) == list(persistent_buffers(plain))


def test_a_data_parallel_learner_syncs_under_the_plain_names_beside_a_plain_learner():
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    wrapped, plain = nn.DataParallel(TinyNet(seed=1)), TinyNet(seed=2)
    assert all(name.startswith("module.") for name, _ in wrapped.named_parameters())
    wrapped_optimizer, plain_optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1), torch.optim.SGD(
        plain.parameters(), lr=0.1)
    with (ddiloco.session(wrapped, wrapped_optimizer, hub=hub, learner_id=0, inner_steps=4) as first,
          ddiloco.session(plain, plain_optimizer, hub=hub, learner_id=1, inner_steps=4) as second):
        names = [t.name for t in hub.syncer.spec.tensors]
        assert names == [name for name, _ in plain.named_parameters()]
        for batch in make_batches(4, seed=0):
            first.step(tokens=train_step(wrapped, wrapped_optimizer, batch))
            second.step(tokens=train_step(plain, plain_optimizer, batch))
    assert first.final_state == "done" and hub.syncer.rounds_committed >= 1
