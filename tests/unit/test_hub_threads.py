"""Learners of one `InProcessHub`, each training on a thread of its own (as a test suite or a notebook might run
them): the hub keeps the syncer core to one call at a time. Without that, two threads corrupted its rounds: learners
saw checksums that did not match the syncer's, and a thread died with a KeyError inside the core."""

from __future__ import annotations

import logging
import threading

import torch

import ddiloco
from tests.helpers import TinyNet, make_batches, train_step

INNER_STEPS = 150
WAIT_S = 120.0


def test_learners_of_one_hub_on_threads_of_their_own_train_without_corrupting_the_syncer(caplog):
    hub = ddiloco.InProcessHub(config=ddiloco.DilocoConfig(num_fragments=2, sync_every=4),
                               quorum=ddiloco.QuorumConfig(grace="none"))
    errors, finished = [], {}

    def learner(learner_id: int) -> None:
        try:
            model = TinyNet(seed=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            batches = make_batches(INNER_STEPS, seed=10 + learner_id)
            with ddiloco.session(model, optimizer, hub=hub, learner_id=learner_id, inner_steps=INNER_STEPS) as sync:
                while not sync.done:
                    if sync.ready:
                        sync.step(tokens=train_step(model, optimizer, batches[sync.inner_step]))
            finished[learner_id] = sync.final_state
        except BaseException as exc:  # noqa: BLE001 -- the thread's failure is the test's
            errors.append(f"learner {learner_id}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=learner, args=(i,), name=f"trainer-{i}") for i in range(2)]
    with caplog.at_level(logging.WARNING):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == [] and finished == {0: "done", 1: "done"}
    assert not [r.getMessage() for r in caplog.records if "cannot rebuild" in r.getMessage()]
    assert hub.syncer.rounds_committed > 0
