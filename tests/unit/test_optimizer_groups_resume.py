"""A learner whose script adds an optimizer parameter group during the run (`optimizer.add_param_group`, to unfreeze
layers) resumes from its checkpoint: the groups its optimizer has at the session's start are restored there, the
others when the script adds them again (in process, a real restart from the run directory)."""

from __future__ import annotations

import logging

import pytest
import torch

import ddiloco
from tests.helpers import TinyNet, make_batches, train_step

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")
UNFREEZE_AT = 4
"""The inner step from which the script trains its first block too."""


def hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def frozen_model():
    """The model with its first block frozen, and an AdamW over the rest: one parameter group."""
    model = TinyNet(seed=1)
    model.blocks[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def unfreeze(model, optimizer, lr=1e-2):
    model.blocks[0].requires_grad_(True)
    optimizer.add_param_group({"params": list(model.blocks[0].parameters()), "lr": lr})


def train(shared, run_dir, *, inner_steps, unfreeze_at=UNFREEZE_AT):
    """One process of learner 0 running the script: unfreezes its first block once `sync.inner_step` reaches
    `unfreeze_at` (a restarted learner resumes past it, so the script's test is >=)."""
    model, optimizer = frozen_model()
    batches = iter(make_batches(inner_steps, seed=0))
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=inner_steps,
                         run_dir=run_dir) as sync:
        while not sync.done:
            if sync.inner_step >= unfreeze_at and not model.blocks[0].weight.requires_grad:
                unfreeze(model, optimizer)
            sync.step(tokens=train_step(model, optimizer, next(batches)))
    return model, optimizer, sync


def adam_steps(optimizer, param):
    return int(optimizer.state[param]["step"])


def test_a_group_added_during_the_run_is_restored_when_the_restarted_script_adds_it(tmp_path, caplog):
    # Every restart failed: "holds optimizer state for 2 parameter groups ... but this script's optimizer has 1".
    shared = hub()
    model, optimizer, _ = train(shared, tmp_path, inner_steps=8)
    assert len(optimizer.param_groups) == 2 and adam_steps(optimizer, model.blocks[0].weight) == 4
    saved_moment = optimizer.state[model.blocks[0].weight]["exp_avg"].clone()
    optimizer.param_groups[1]["lr"] = 3e-3  # (a schedule of the script's: the checkpoint below keeps it)

    # The script's own restart: the group is added back at its first step, and its state comes back with it.
    with caplog.at_level(logging.WARNING):
        again, again_optimizer, sync = train(shared, tmp_path, inner_steps=8)  # at 8, nothing more to train
    assert sync.inner_step == 8 and len(again_optimizer.param_groups) == 1  # done at once: never re-added
    assert ("holds 2 parameter groups of 4 + 2 parameters; this script's optimizer has 1 so far: the others are "
            "restored when the script adds them again" in caplog.text)
    assert "must test sync.inner_step >= that step" in caplog.text
    model, optimizer = frozen_model()
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=12, run_dir=tmp_path) as sync:
        assert sync.inner_step == 8 and len(optimizer.param_groups) == 1
        unfreeze(model, optimizer, lr=1e-2)
        first = model.blocks[0].weight
        seen = {}
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.update(
            exp_avg=opt.state[first]["exp_avg"].clone(), step=int(opt.state[first]["step"]),
            lr=opt.param_groups[1]["lr"]))
        batches = iter(make_batches(4, seed=1))
        while not sync.done:
            sync.step(tokens=train_step(model, optimizer, next(batches)))
            if sync.inner_step == 9:
                # Just before its first step here, the group held the state it had at the checkpoint.
                assert seen["step"] == 4 and torch.equal(seen["exp_avg"], saved_moment)
                assert adam_steps(optimizer, first) == 5
    assert adam_steps(optimizer, first) == 8 and adam_steps(optimizer, model.blocks[1].weight) == 12


def test_the_group_still_waiting_is_kept_by_a_checkpoint_taken_before_it_is_added(tmp_path):
    shared = hub()
    model, optimizer, _ = train(shared, tmp_path, inner_steps=8)
    # A process that resumes at 8 and checkpoints at 10 before the script adds the group back (it unfreezes at 11)...
    train(shared, tmp_path, inner_steps=10, unfreeze_at=11)
    # ...then one that adds it: the state from the first process's checkpoint is still there.
    model, optimizer, sync = train(shared, tmp_path, inner_steps=12, unfreeze_at=10)
    assert sync.inner_step == 12 and adam_steps(optimizer, model.blocks[0].weight) == 4 + 2


def test_a_group_of_another_size_than_the_checkpoints_is_refused_at_its_first_step(tmp_path):
    shared = hub()
    train(shared, tmp_path, inner_steps=8)
    model, optimizer = frozen_model()
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=12, run_dir=tmp_path) as sync:
        optimizer.add_param_group({"params": [model.blocks[0].weight]})  # the bias stays out this time
        model.blocks[0].weight.requires_grad_(True)
        with pytest.raises(ValueError, match=r"learner 0's checkpoint in .* holds optimizer state for parameter group "
                                             r"1 of 2 parameters, but the group this script's optimizer gained "
                                             r"\(optimizer.add_param_group\) has 1"):
            train_step(model, optimizer, make_batches(1, seed=2)[0])
        assert sync.inner_step == 8


def test_groups_created_before_the_session_that_the_checkpoint_lacks_start_afresh(tmp_path):
    # The way to write it without add_param_group: every group from the start, lr 0 until unfrozen. A checkpoint
    # of the run taken before such a script's change holds one group fewer.
    shared = hub()
    train(shared, tmp_path, inner_steps=2)  # checkpoint at 2, one group
    model, optimizer = frozen_model()
    unfreeze(model, optimizer, lr=0.0)
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=4, run_dir=tmp_path) as sync:
        assert sync.inner_step == 2 and adam_steps(optimizer, model.blocks[1].weight) == 2
        assert model.blocks[0].weight not in optimizer.state


def test_a_checkpoint_whose_first_groups_differ_is_still_refused_as_a_changed_model(tmp_path):
    shared = hub()
    train(shared, tmp_path, inner_steps=8)  # groups of 4 and 2 parameters
    model = TinyNet(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # one group of 6
    with pytest.raises(ValueError, match=r"holds optimizer state for 2 parameter groups of 4 \+ 2 parameters, but "
                                         r"this script's optimizer has 1 parameter group of 6 parameters"):
        ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=12, run_dir=tmp_path).start()


def test_a_group_added_back_just_before_a_checkpoint_keeps_its_state(tmp_path):
    # The checkpoint took the optimizer's state before loading the group the script had just added (the step pre-hook
    # had not run yet), so it kept that group without its state, and the next restart trained it from scratch.
    shared = hub()
    train(shared, tmp_path, inner_steps=8)  # the first block's AdamW state: 4 steps
    model, optimizer = frozen_model()
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=12, run_dir=tmp_path) as sync:
        unfreeze(model, optimizer)  # added back; the session ends, and checkpoints, before the next step
        sync.request_stop()
    model, optimizer, sync = train(shared, tmp_path, inner_steps=12, unfreeze_at=8)
    assert sync.inner_step == 12 and adam_steps(optimizer, model.blocks[0].weight) == 4 + 4
