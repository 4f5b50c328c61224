"""A session whose close fails or is interrupted still releases its threads, connection and files, and says it failed:
it was marked closed before the rest ran, so an interrupted close (a second Ctrl-C in a notebook, a `state=` object
whose state_dict raises at the final checkpoint) left a learner connected, with its threads, for the life of the
process, status.json saying "training" for ever, and every later session of that learner refused as a second
process (over gRPC)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

import ddiloco
from tests.helpers import TinyNet

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")
RUN = ddiloco.RunConfig(diloco=CONFIG, num_learners=1, inner_steps=100)


def open_files() -> set[str]:
    """The files this process holds open (links of /proc/self/fd that name a path)."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/"):
            paths.add(target)
    return paths


class BrokenAtTheEnd:
    """A `state=` object whose state_dict fails once `broken` is set (a data position on a disk that went away)."""

    broken = False

    def state_dict(self):
        if self.broken:
            raise OSError("the disk holding the data position is gone")
        return {"position": 0}

    def load_state_dict(self, state):
        pass


def session_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("learner-") and t.is_alive()]


def train(sync, model, optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randint(0, 16, (4, 6))).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=24)


def test_a_close_that_fails_releases_the_session_and_says_it_failed(tmp_path):
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    model = TinyNet(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = BrokenAtTheEnd()
    with pytest.raises(OSError, match="disk holding the data position"), ddiloco.session(  # noqa: PT012
            model, optimizer, hub=hub, learner_id=0, run_dir=tmp_path, state={"data": data},
            checkpoint_every_s=3600) as sync:
        train(sync, model, optimizer, 4)
        data.broken = True
    assert session_threads() == []
    status = json.loads((tmp_path / "learners" / "0" / "status.json").read_text())
    assert status["state"] == "failed" and sync.final_state == "failed", status
    data.broken = False
    with ddiloco.session(model, optimizer, hub=hub, learner_id=0, run_dir=tmp_path, state={"data": data},
                         inner_steps=12) as again:
        while not again.done:
            train(again, model, optimizer, 1)
    assert again.final_state == "done" and again.inner_step == 12
    assert session_threads() == []


def test_a_session_made_and_never_started_or_refused_at_its_start_lets_go_of_its_thread_and_files(tmp_path):
    # Each kept its publisher thread (over gRPC), work.jsonl and metrics.jsonl open for the life of the process.
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    model = TinyNet(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = open_files()
    unstarted = ddiloco.session(model, optimizer, syncer="127.0.0.1:1", learner_id=0, config=RUN, run_dir=tmp_path)
    assert session_threads() == []  # the publisher's thread starts with the session (it started as it was made)
    unstarted.close()
    with pytest.raises(RuntimeError, match="this one was closed first"):
        unstarted.start()
    with ddiloco.session(model, optimizer, hub=hub, learner_id=0, run_dir=tmp_path / "a") as sync:
        refused = ddiloco.session(model, optimizer, hub=hub, learner_id=0, run_dir=tmp_path / "b")
        with pytest.raises(RuntimeError, match="a second ddiloco.session"):
            refused.start()
        train(sync, model, optimizer, 2)
    assert session_threads() == [] and open_files() == before
