"""`ddiloco.session` refuses what cannot work with a message that says what to do, and a learner's network thread
that fails does not leave the training thread waiting for ever. Each was found by running a user's script under
`ddiloco run`, where it hung the run or broke another learner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.messages import Join, ModelSpec
from ddiloco.transport.learner_io import LearnerIO
from tests.helpers import StubSyncerClient


def test_a_model_on_the_meta_device_is_refused_before_it_joins():
    # It joined, and the receiver thread died reading the genesis ("Cannot copy out of meta tensor"): the learner
    # sat at "joining" until the run was stopped.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device.*to_empty"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), syncer="127.0.0.1:1", learner_id=0)


def test_the_evaluator_process_is_told_to_watch_not_to_train(monkeypatch):
    # A script that does not branch on the role: its evaluator copy joined as learner 0 (the id in its environment),
    # trained, and the real learner 0 was refused as a duplicate; the run failed.
    monkeypatch.setenv("DDILOCO_ROLE", "evaluator")
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"this process is the run's evaluator.*ddiloco.watch\(model, evaluate\)"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), syncer="127.0.0.1:1", learner_id=0)


class BrokenClient(StubSyncerClient):
    """A `SyncerClient` whose subscription raises what the receiver does not handle (not a gRPC error)."""

    def subscribe(self, join):
        raise NotImplementedError("Cannot copy out of meta tensor")


def test_a_failed_network_thread_is_raised_on_the_training_thread():
    io = LearnerIO(BrokenClient(), Join(0, ModelSpec(()), "x"), heartbeat_every_s=60.0)
    io.start()
    try:
        io.inbox.wait(30.0)  # woken by the failure (before, the receiver died and nothing woke the learner)
        assert isinstance(io.failure, NotImplementedError)
    finally:
        io.close(leave=False)


def test_an_evaluate_function_that_returns_something_else_than_numbers_is_named():
    from ddiloco.evaluator import _as_metrics

    assert _as_metrics({"val_loss": torch.tensor(0.5), "acc": 1}) == {"val_loss": 0.5, "acc": 1.0}
    assert _as_metrics(2) == {"val_loss": 2.0}
    with pytest.raises(TypeError, match=r"returned 'abc' as metric 'acc': expected a number"):
        _as_metrics({"val_loss": 0.5, "acc": "abc"})  # was: could not convert string to float: 'abc'
    with pytest.raises(TypeError, match=r"returned None as its result"):
        _as_metrics(None)


def test_evaluate_runs_without_autograd_and_a_loss_with_its_graph_is_read_quietly(tmp_path):
    # evaluate ran with autograd on: a large evaluation kept every activation for a backward nobody takes, and a loss
    # returned with its graph warned at every evaluation ("Converting a tensor with requires_grad=True to a scalar").
    import warnings

    from ddiloco.evaluator import Watcher
    from ddiloco.messages import FragmentState, Welcome
    from ddiloco.run_config import RunConfig

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    seen = []

    def evaluate(m):
        seen.append(torch.is_grad_enabled())
        with torch.enable_grad():  # a metric that needs gradients asks for them
            return m(torch.ones(3, 2)).pow(2).mean()

    watcher = Watcher(model, evaluate, address="127.0.0.1:1", config=RunConfig(), run_dir=tmp_path)
    welcome = Welcome(learner_id=-1, config_fingerprint="", fragments=(FragmentState(
        fragment=0, version=1, tensors={n: p.detach().clone() for n, p in model.named_parameters()}),))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            watcher._evaluate(welcome)
    finally:
        watcher.sink.close()
        watcher.client.close()
    assert seen == [False] and watcher.latest["val_loss"] > 0


def test_a_tensor_outside_the_model_added_to_the_optimizer_mid_run_is_refused_at_that_step():
    # Checked only at ddiloco.session(...): a learned temperature added with add_param_group at step 3 trained apart
    # on every learner, and a restart set it back while its optimizer state resumed.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hub = ddiloco.InProcessHub(config=ddiloco.DilocoConfig(num_fragments=1, sync_every=4, codec="fp32"),
                               quorum=ddiloco.QuorumConfig(grace="none"))
    with pytest.raises(ValueError) as refused, ddiloco.session(model, optimizer, hub=hub, learner_id=0,
                                                               inner_steps=8) as sync:
        while not sync.done:
            if sync.inner_step == 3:
                optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
            sync.step(tokens=4)
    assert sync.inner_step == 3
    assert str(refused.value).startswith("at inner step 3, after optimizer.add_param_group: the optimizer trains 1 "
                                         "tensor that is no parameter of the model (param group 1, shape (1,))")
    # A group of the model's own parameters (unfreezing layers) is what add_param_group is for: it trains on.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with ddiloco.session(model, optimizer, hub=hub, learner_id=1, inner_steps=8) as sync:
        while not sync.done:
            if sync.inner_step == 3:
                optimizer.add_param_group({"params": list(model[1].parameters())})
            sync.step(tokens=4)
    assert sync.final_state == "done"


def test_an_optimizer_training_parameters_outside_the_model_is_refused_naming_them():
    # Learnable loss weights kept beside the model were trained, never synced, checkpointed or exported; a restart
    # set them back to their initial values while their AdamW moments resumed from the checkpoint. Silently.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    log_vars = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": model.parameters()}, {"params": [log_vars], "weight_decay": 0.0}])
    with pytest.raises(ValueError) as refused:
        ddiloco.session(model, optimizer, syncer="127.0.0.1:1", learner_id=0)
    assert str(refused.value) == (
        "the optimizer trains 1 tensor that is no parameter of the model (param group 1, shape (2,)): the run syncs, "
        "checkpoints and exports only the model's parameters, so every learner would train it apart and a restart "
        "would set it back to its initial value; make it part of the model (an nn.Parameter attribute of the model "
        "or of one of its modules)")
