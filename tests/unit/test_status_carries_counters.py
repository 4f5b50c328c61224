"""A learner's counters and tokens in status.json (and so summary.json) count every process of the learner, also the
ones that ended before any checkpoint of theirs (`StatusReporter.carry_over`)."""

from __future__ import annotations

import json
import shutil

import torch
from torch import nn

import ddiloco

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def train(run_dir, shared, *, inner_steps):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=inner_steps,
                         run_dir=run_dir) as sync:
        steps = 0
        while not sync.done:
            x = torch.randn(16, 3)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=16)
            steps += 1
    return steps


def status(run_dir):
    return json.loads((run_dir / "learners" / "0" / "status.json").read_text())


def test_a_process_that_left_no_checkpoint_still_counts_in_the_next_ones_status(tmp_path):
    shared = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    train(tmp_path, shared, inner_steps=8)
    first = status(tmp_path)
    assert first["tokens"] == 8 * 16 and first["updates_sent"] >= 4
    # The first process ended before any checkpoint of its own (a kill -9 before its first one): the next one takes the
    # run's position and trains on from there.
    shutil.rmtree(tmp_path / "learners" / "0" / "checkpoint")
    steps = train(tmp_path, shared, inner_steps=12)
    second = status(tmp_path)
    assert second["inner_step"] == 12 and steps >= 1
    assert second["tokens"] == (8 + steps) * 16  # the first process's steps, then the second's
    assert second["updates_sent"] >= first["updates_sent"] + 2
    assert second["fragments_applied"] > first["fragments_applied"]
    assert second["bytes_sent"] > first["bytes_sent"]


def test_a_restored_process_counts_from_the_later_of_its_checkpoint_and_the_last_status(tmp_path):
    shared = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    train(tmp_path, shared, inner_steps=8)
    first = status(tmp_path)
    train(tmp_path, shared, inner_steps=8)  # resumed at the budget: trains nothing, sends nothing
    again = status(tmp_path)
    assert again["tokens"] == first["tokens"] and again["updates_sent"] == first["updates_sent"]
