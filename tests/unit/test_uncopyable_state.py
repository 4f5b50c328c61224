"""A `state=` object whose state_dict() returns a value that cannot even be copied (a lock, an open file): the
checkpoint took a deep copy before it split the state, and that copy raised `cannot pickle '_thread.lock' object`
from deep inside `copy`, naming no entry; at the session's closing checkpoint it raised again over the first error.
Now the same error as for any value a checkpoint cannot keep, naming the entry, raised once. A tensor with autograd
history, which `copy.deepcopy` refuses, is kept; the snapshot is still the state at the checkpoint, whatever the loop
changes in place while it is written."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import ddiloco
import ddiloco.learner_checkpoint as learner_checkpoint
from ddiloco.checkpoint import load_latest_state
from tests.helpers import TinyNet

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


class LockingCursor:
    """A data position whose state_dict() holds a lock from inner step `bad_at` on."""

    def __init__(self, bad_at: int) -> None:
        self.position, self.bad_at = 0, bad_at

    def state_dict(self):
        state = {"position": self.position}
        if self.position >= self.bad_at:
            state["lock"] = threading.Lock()
        return state

    def load_state_dict(self, state):
        self.position = state["position"]


def run(tmp_path, cursor: LockingCursor, *, inner_steps: int = 6):
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    with ddiloco.session(model, optimizer, state={"data": cursor}, hub=hub, learner_id=0, inner_steps=inner_steps,
                         run_dir=tmp_path, checkpoint_every_s=1e-6) as sync:
        while not sync.done:
            cursor.position += 1
            sync.step(tokens=4)
    return sync


ERROR = r"learner 0 cannot checkpoint the lock at /lock in state\['data'\]\.state_dict\(\)"


@pytest.mark.parametrize("bad_at", [0, 3], ids=["from-the-start", "mid-run"])
def test_a_state_dict_holding_a_lock_is_refused_naming_the_entry_once(tmp_path, caplog, bad_at):
    # A budget the loop does not reach: it ends at the first periodic checkpoint past `bad_at` (one falling due while
    # the one before is written waits for that write, so which step that is depends on the machine's load).
    with caplog.at_level(logging.ERROR), pytest.raises(TypeError, match=ERROR) as raised:
        run(tmp_path, LockingCursor(bad_at), inner_steps=10_000)
    assert raised.value.__context__ is None or "pickle" not in str(raised.value.__context__)
    assert "cannot pickle" not in str(raised.value)
    assert "no checkpoint: learner 0 cannot checkpoint" in caplog.text  # the closing one: logged, not raised again


class Average:
    """An average of the model's parameters computed with autograd on (outside torch.no_grad()): its tensors are not
    graph leaves, which `copy.deepcopy` refuses (`Only Tensors created explicitly by the user ...`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.values = [p.detach().clone() for p in model.parameters()]

    def update(self) -> None:
        self.values = [0.5 * v + 0.5 * p for v, p in zip(self.values, self.model.parameters(), strict=True)]

    def state_dict(self):
        return {"values": self.values}

    def load_state_dict(self, state):
        self.values = list(state["values"])


def test_a_tensor_with_autograd_history_is_checkpointed_and_comes_back(tmp_path):
    # The deep copy raised RuntimeError from inside `copy` at the first checkpoint, and the user's loop ended on it.
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = Average(model)
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    with ddiloco.session(model, optimizer, state={"average": average}, hub=hub, learner_id=0, inner_steps=6,
                         run_dir=tmp_path, checkpoint_every_s=1e-6) as sync:
        while not sync.done:
            optimizer.zero_grad()
            model(torch.randint(0, 16, (2, 4))).square().mean().backward()
            optimizer.step()
            average.update()
            sync.step(tokens=2)
    assert all(value.grad_fn is not None for value in average.values)
    saved = load_latest_state(tmp_path / "learners" / "0" / "checkpoint")[0]["state"]["average"]["values"]
    assert all(torch.equal(s, v.detach()) for s, v in zip(saved, average.values, strict=True))


def test_the_checkpoint_holds_the_state_at_its_step_while_the_loop_changes_it_in_place(tmp_path, monkeypatch):
    # The write is a background thread's; the loop goes on updating its tensors in place meanwhile.
    writing, changed = threading.Event(), threading.Event()
    real_save = learner_checkpoint.save_split_state

    def slow_save(*args, **kwargs):
        writing.set()
        assert changed.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(learner_checkpoint, "save_split_state", slow_save)
    cursor = {"seen": torch.zeros(3)}

    class Seen:
        def state_dict(self):
            return {"seen": cursor["seen"]}  # the live tensor, as optimizers and loaders return theirs

        def load_state_dict(self, state):
            pass

    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    with ddiloco.session(model, optimizer, state={"seen": Seen()}, hub=hub, learner_id=0, inner_steps=10**6,
                         run_dir=tmp_path, checkpoint_every_s=10**6) as sync:
        cursor["seen"] += 1
        sync.step(tokens=2)
        sync._checkpoint.save(wait=False)  # what a periodic checkpoint does
        assert writing.wait(30)
        cursor["seen"] += 100  # in place, while it is written
        changed.set()
        sync._checkpoint._saver.join()
        monkeypatch.setattr(learner_checkpoint, "save_split_state", real_save)
        saved = load_latest_state(tmp_path / "learners" / "0" / "checkpoint")[0]["state"]["seen"]["seen"]
        assert torch.equal(saved, torch.ones(3))
        sync.request_stop()
