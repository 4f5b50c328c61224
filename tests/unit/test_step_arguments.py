"""What `sync.step(tokens, loss=...)` and `ddiloco.session(learner_id=...)` accept: a bad value is refused with an
error naming it, before the inner step counts (in process, the hub)."""

from __future__ import annotations

import warnings

import pytest
import torch

import ddiloco
from tests.helpers import TinyNet

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def hub(**quorum):
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none", **quorum))


def test_a_loss_that_is_not_one_number_is_refused_before_the_step_counts():
    # loss=torch.ones(3) raised torch's "only one element tensors can be converted to Python scalars" after the
    # inner step had counted (and its update gone out).
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0) as sync:
        sync.step(tokens=4, loss=1.5)
        with pytest.raises(ValueError, match=r"loss=<a tensor of shape \(3,\)> is invalid: expected one number \(the "
                                             r"step's loss: a float, or a tensor of one element: loss.item\(\)\)$"):
            sync.step(tokens=4, loss=torch.ones(3))
        with pytest.raises(TypeError, match=r"loss='abc' is invalid: expected one number .*, got a str"):
            sync.step(tokens=4, loss="abc")
        assert sync.inner_step == 1 and sync.reporter.progress.loss == 1.5


def test_a_loss_as_a_tensor_a_numpy_number_or_nan_is_taken_as_a_float():
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0) as sync:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when a tensor that requires grad becomes a float
            sync.step(tokens=4, loss=torch.tensor(2.5, requires_grad=True) * 1)
        assert sync.reporter.progress.loss == 2.5
        sync.step(tokens=4, loss=torch.tensor([[0.5]]))
        assert sync.reporter.progress.loss == 0.5
        sync.step(tokens=4, loss=float("nan"))
        assert sync.inner_step == 3 and type(sync.reporter.progress.loss) is float


def test_tokens_beyond_what_the_syncer_accepts_are_refused_at_the_step():
    # tokens=2**70 was taken, and the syncer then rejected every update as bad_counters while the loop trained on.
    model = TinyNet(seed=1)
    shared = hub(max_tokens_per_step=1000)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0) as sync:
        sync.step(tokens=1000)
        with pytest.raises(ValueError, match=r"tokens=1180591620717411303424 is more than one inner step may count: "
                                             r"the run's max_tokens_per_step is 1000, .*--max-tokens-per-step"):
            sync.step(tokens=2**70)
        with pytest.raises(ValueError, match=r"tokens=1001 is more than"):
            sync.step(tokens=1001)
        assert sync.inner_step == 1
        while sync.inner_step < 8:
            sync.step(tokens=1000)
    assert not shared.syncer.rejection_counts  # every update within the bound: none rejected as bad_counters
    assert shared.syncer.rounds_committed >= 3


def test_a_negative_learner_id_is_refused_naming_it():
    # It said "the run has 2147483647 learners": the in-process hub's unbounded count.
    model = TinyNet(seed=1)
    with pytest.raises(ValueError, match=r"learner_id=-1 is invalid: expected an integer >= 0 \(this learner's id\)$"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=-1)
    with pytest.raises(ValueError, match=r"learner_id='0' is invalid: expected an integer >= 0"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id="0")


def test_a_script_logs_its_own_metrics_beside_the_loss_at_the_step_it_trained():
    # Before: no way but the session's own sink, which wrote a tensor as the string "tensor(0.7500)" (TensorBoard
    # dropped it), took any name (one could overwrite learner/0/loss) and, called before sync.step(), put the step's
    # values one step before its loss.
    import numpy as np

    from ddiloco.metrics import MemorySink

    sink = MemorySink()
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0,
                         sink=sink) as sync:
        sync.step(tokens=4, loss=1.5)
        sync.log({"acc": torch.tensor(0.75), "lr": np.float32(0.5), "grad/norm": 3})
        sync.log({"acc": 0.5}, step=7)
        with pytest.raises(ValueError, match="metric name 'loss' is ddiloco's own \\(learner/0/loss\\)"):
            sync.log({"acc": 0.1, "loss": 1.0})
        with pytest.raises(ValueError, match=r"acc=<a tensor of shape \(2,\)> is invalid: expected one number"):
            sync.log({"acc": torch.ones(2)})
        with pytest.raises(ValueError, match="metric name 'a b' is invalid"):
            sync.log({"a b": 1})
        with pytest.raises(TypeError, match="acc='high' is invalid: expected one number .*, got a str"):
            sync.log({"acc": "high"})
    assert sink.series("learner/0/acc") == [(1, 0.75), (7, 0.5)]  # nothing of the refused calls
    assert sink.series("learner/0/loss") == [(1, 1.5)]
    assert sink.series("learner/0/lr") == [(1, 0.5)] and sink.series("learner/0/grad/norm") == [(1, 3.0)]
    assert all(type(value) is float for name in ("acc", "lr", "grad/norm")
               for _, value in sink.series(f"learner/0/{name}"))  # a number, not a tensor's text


def test_a_rank_other_than_0_takes_the_same_log_calls_and_writes_nothing():
    # A multi-rank loop calls sync.log on every rank: it raised AttributeError on the ranks after 0.
    from types import SimpleNamespace

    from ddiloco.follower_session import FollowerSession

    follower = SimpleNamespace(learner_id=1)
    assert FollowerSession.log(follower, {"acc": torch.tensor(0.5)}) is None
    with pytest.raises(ValueError, match="metric name 'loss' is ddiloco's own \\(learner/1/loss\\)"):
        FollowerSession.log(follower, {"loss": 1.0})
