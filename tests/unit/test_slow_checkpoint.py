"""A periodic checkpoint that falls due while the one before is still being written waits for that write, not the
training loop. Before 2026-12-07 the loop joined the writing thread: a model whose checkpoint takes longer to write
than `checkpoint_every_s` (a billion parameters with AdamW is 12 GB; a slow or network disk) stopped training for the
difference at every checkpoint."""

from __future__ import annotations

import logging
import threading

import torch

import ddiloco
import ddiloco.learner_checkpoint as learner_checkpoint
from tests.helpers import TinyNet, make_batches, train_step

FAIL_SAFE_S = 30.0
"""Releases the held write if the loop never does (the fault: the loop is blocked on that write)."""


def test_the_loop_trains_on_while_a_checkpoint_is_written_and_the_next_is_taken_after_it(tmp_path, monkeypatch,
                                                                                            caplog):
    release, held = threading.Event(), threading.Event()
    written = []
    real_save = learner_checkpoint.save_split_state

    def slow_save(directory, split, *, serial, meta):
        if serial == 1:  # the first periodic checkpoint: its write takes until the loop lets it go
            held.set()
            release.wait(FAIL_SAFE_S)
        written.append(serial)
        return real_save(directory, split, serial=serial, meta=meta)

    monkeypatch.setattr(learner_checkpoint, "save_split_state", slow_save)
    fail_safe = threading.Timer(FAIL_SAFE_S, release.set)
    fail_safe.start()
    hub = ddiloco.InProcessHub(config=ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32"),
                               quorum=ddiloco.QuorumConfig(grace="none"))
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(make_batches(30, seed=0))
    trained_while_held = 0
    try:
        with caplog.at_level(logging.WARNING), ddiloco.session(
                model, optimizer, hub=hub, learner_id=0, inner_steps=30, run_dir=tmp_path,
                checkpoint_every_s=1e-9) as sync:
            while not sync.done:
                sync.step(tokens=train_step(model, optimizer, next(batches)))
                if held.is_set() and not release.is_set():
                    trained_while_held += 1
                    if trained_while_held == 10:
                        release.set()  # ten steps trained past a checkpoint due at every step: let the write end
    finally:
        fail_safe.cancel()
    assert trained_while_held == 10  # with the fault: 1, then blocked until the fail-safe
    assert written[0] == 1 and written[-1] == 30 and len(written) > 2, written  # more were taken once it ended
    assert "takes longer to write than checkpoint_every_s" in caplog.text, caplog.text
