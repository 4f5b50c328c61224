"""`ddiloco.session` refuses at once what a model holds that the run cannot keep: a persistent buffer of a dtype a
learner's checkpoint cannot store, and two parameters that share memory. Tied weights and parameters cut from one
flat buffer without overlapping train as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddiloco
from tests.helpers import TinyNet

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def train(model, inner_steps=8):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddiloco.session(model, optimizer, hub=hub(), learner_id=0, inner_steps=inner_steps) as sync:
        while not sync.done:
            sync.step(tokens=4)
    return sync


def test_a_buffer_a_checkpoint_cannot_keep_is_refused_at_the_start_naming_it():
    # A complex128 buffer trained to the end of the budget, then failed at the closing checkpoint (and again at every
    # restart: the run gave up after three).
    model = TinyNet(seed=1)
    model.register_buffer("twiddle", torch.randn(4, dtype=torch.complex128))
    with pytest.raises(TypeError, match=r"buffer 'twiddle' is complex128, which a learner's checkpoint cannot keep .*"
                                        r"complex64, or register it with persistent=False"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0)
    model.register_buffer("twiddle", torch.randn(4, dtype=torch.complex128), persistent=False)  # rebuilt, not kept
    assert train(model).final_state == "done"


def test_two_parameters_that_share_memory_are_refused_naming_both():
    # Each was synchronised on its own: in every learner w[:2] == w_top, in the global model they differed by 0.036.
    model = TinyNet(seed=1)
    flat = torch.randn(4, 3)
    model.w = nn.Parameter(flat)
    model.w_top = nn.Parameter(flat[:2])
    with pytest.raises(ValueError, match=r"parameters 'w' and 'w_top' share memory \(one is a view of the other\)"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0)


def test_tied_weights_and_parameters_cut_from_one_flat_buffer_without_overlap_train():
    model = TinyNet(seed=1)
    flat = torch.randn(24)
    model.first, model.second = nn.Parameter(flat[:10]), nn.Parameter(flat[10:])  # side by side
    grid = torch.randn(3, 4)
    model.even, model.odd = nn.Parameter(grid[:, ::2]), nn.Parameter(grid[:, 1::2])  # interleaved: no element shared
    model.tied = nn.Linear(3, 3)
    model.also_tied = model.tied  # one module under two names
    assert train(model).final_state == "done"
