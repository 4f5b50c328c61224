"""A session and the process's signals, over real gRPC to a syncer served in this process: a second session of the same
learner inside the first is refused at its start."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.config import DilocoConfig
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.transport.grpc_server import start_server

RUN = RunConfig(diloco=DilocoConfig(num_fragments=2, sync_every=4), num_learners=1, inner_steps=1000)
WAIT_S = 30.0


@pytest.fixture
def syncer(tmp_path):
    """The address of a syncer serving RUN from this process (the first learner gives the genesis)."""
    service = SyncerService(RUN, None, SyncerStore(tmp_path / "syncer"), sink=NullSink())
    server, port = start_server(service, "127.0.0.1:0", token=None)
    service.start(f"127.0.0.1:{port}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        service.close(server)


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(sync, model, optimizer, *, on_step=lambda inner_step: None) -> None:
    generator = torch.Generator().manual_seed(0)
    while not sync.done:
        x = torch.randn(8, 4, generator=generator)
        loss = nn.functional.mse_loss(model(x), x[:, :2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=len(x))
        on_step(sync.inner_step)


def test_a_session_inside_an_open_session_of_the_same_learner_is_refused_at_its_start(syncer, tmp_path):
    # It joined as a second learner 0 and was refused by the syncer: "learner 0 is already connected ... two processes
    # were started with --learner-id 0 (stop one)", exit 3.
    model, optimizer = model_and_optimizer()
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as outer:
        inner = ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run")
        with pytest.raises(RuntimeError, match=r"^a second ddiloco.session\(\.\.\.\) of learner 0 while the first "
                                               r"is still open in this process: .* End the first `with"):
            inner.start()
        train(outer, model, optimizer, on_step=lambda s: s == 2 and outer.request_stop())
    assert outer.final_state == "stopped"
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as again:
        assert again.inner_step == 2  # one after the other is fine: it resumed from the first one's checkpoint
