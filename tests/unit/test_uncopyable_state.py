"""A `state=` object whose state_dict() returns a value that cannot even be copied (a lock, an open file): the
checkpoint takes a deep copy before it splits the state, and that copy raised `cannot pickle '_thread.lock' object`
from deep inside `copy`, naming no entry; at the session's closing checkpoint it raised again over the first error.
Now the same error as for any value a checkpoint cannot keep, naming the entry, raised once."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import ddiloco
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
    with caplog.at_level(logging.ERROR), pytest.raises(TypeError, match=ERROR) as raised:
        run(tmp_path, LockingCursor(bad_at))
    assert raised.value.__context__ is None or "pickle" not in str(raised.value.__context__)
    assert "cannot pickle" not in str(raised.value)
    assert "no checkpoint: learner 0 cannot checkpoint" in caplog.text  # the closing one: logged, not raised again
