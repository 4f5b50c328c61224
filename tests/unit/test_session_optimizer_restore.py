"""What a session loads into the optimizer it is given, and what it says about `state=` objects it cannot restore:
a second session of the same process with a new optimizer keeps that optimizer's own settings; a checkpoint of
another optimizer class is not loaded into it; a restarted script's optimizer is restored as saved; a learner with
no checkpoint of its own that takes the run's position says that its `state=` objects start afresh there."""

from __future__ import annotations

import logging

import torch

import ddiloco
from tests.helpers import TinyNet, make_batches, train_step

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


class Counter:
    """A `state=` object: how many batches the script has drawn."""

    def __init__(self) -> None:
        self.drawn = 0

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state) -> None:
        self.drawn = int(state["drawn"])


def hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def train(shared, model, optimizer, run_dir, *, inner_steps, learner_id=0, state=None, seed=0):
    """One session of the script: trains `model` with `optimizer` until the budget; returns the session."""
    batches = iter(make_batches(inner_steps, seed=seed))
    with ddiloco.session(model, optimizer, hub=shared, learner_id=learner_id, inner_steps=inner_steps,
                         run_dir=run_dir, state=state) as sync:
        while not sync.done:
            sync.step(tokens=train_step(model, optimizer, next(batches)))
    return sync


def test_a_second_session_with_a_new_optimizer_keeps_that_optimizers_settings(tmp_path):
    # It started with the first optimizer's lr 0.002, weight decay 0.01 and Adam state, silently.
    shared, model = hub(), TinyNet(seed=1)
    train(shared, model, torch.optim.AdamW(model.parameters(), lr=2e-3), tmp_path, inner_steps=8)
    second = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    with ddiloco.session(model, second, hub=shared, learner_id=0, inner_steps=12, run_dir=tmp_path) as sync:
        assert sync.inner_step == 8  # the run's position continues
        assert (second.param_groups[0]["lr"], second.param_groups[0]["weight_decay"]) == (1e-4, 0.0)
        assert len(second.state) == 0


def test_a_second_session_with_sgd_after_adamw_trains(tmp_path, caplog):
    # KeyError: 'momentum' in torch/optim/sgd.py at its first step: AdamW's param_groups loaded into SGD.
    shared, model = hub(), TinyNet(seed=1)
    train(shared, model, torch.optim.AdamW(model.parameters(), lr=2e-3), tmp_path, inner_steps=8)
    second = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with caplog.at_level(logging.WARNING):
        sync = train(shared, model, second, tmp_path, inner_steps=12, seed=1)
    assert sync.inner_step == 12 and second.param_groups[0]["momentum"] == 0.9
    assert "torch.optim.adamw.AdamW" in caplog.text and "torch.optim.sgd.SGD" in caplog.text


def test_the_same_optimizer_in_a_second_session_keeps_its_state_and_settings(tmp_path):
    shared, model = hub(), TinyNet(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    train(shared, model, optimizer, tmp_path, inner_steps=8)
    steps = int(optimizer.state[model.lm_head.weight]["step"])
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=12, run_dir=tmp_path) as sync:
        assert sync.inner_step == 8
        assert optimizer.param_groups[0]["lr"] == 2e-3 and int(optimizer.state[model.lm_head.weight]["step"]) == steps


def test_a_restarted_script_with_another_optimizer_class_starts_it_afresh_with_a_warning(tmp_path, caplog):
    # KeyError: 'momentum' at the restarted script's first step.
    shared, model = hub(), TinyNet(seed=1)
    train(shared, model, torch.optim.AdamW(model.parameters(), lr=2e-3), tmp_path, inner_steps=8)
    again = TinyNet(seed=1)  # the restarted script builds its model and optimizer anew
    optimizer = torch.optim.SGD(again.parameters(), lr=1e-2, momentum=0.9)
    with caplog.at_level(logging.WARNING):
        sync = train(shared, again, optimizer, tmp_path, inner_steps=12, seed=1)
    assert sync.inner_step == 12 and optimizer.param_groups[0]["lr"] == 1e-2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "AdamW" in r.getMessage()]
    assert len(warnings) == 1 and "torch.optim.sgd.SGD" in warnings[0]


def test_a_restarted_script_gets_its_optimizer_back_as_saved(tmp_path):
    shared, model = hub(), TinyNet(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    train(shared, model, optimizer, tmp_path, inner_steps=8)
    optimizer.param_groups[0]["lr"] = 5e-4
    again = TinyNet(seed=1)
    restored = torch.optim.AdamW(again.parameters(), lr=2e-3)
    with ddiloco.session(again, restored, hub=shared, learner_id=0, inner_steps=8, run_dir=tmp_path) as sync:
        assert sync.inner_step == 8
        assert restored.param_groups[0]["lr"] == 2e-3  # the checkpoint was taken before the lr changed
        assert int(restored.state[again.lm_head.weight]["step"]) == int(optimizer.state[model.lm_head.weight]["step"])


def test_a_restarted_script_whose_optimizer_settings_changed_is_told_the_checkpoints_are_used(tmp_path, caplog):
    # A resume with `-- python train.py --lr 1e-5` trained on at the checkpoint's 2e-3, and nothing said so.
    shared, model = hub(), TinyNet(seed=1)
    train(shared, model, torch.optim.AdamW(model.parameters(), lr=2e-3), tmp_path, inner_steps=8)
    again = TinyNet(seed=1)
    restored = torch.optim.AdamW(again.parameters(), lr=1e-5, weight_decay=0.5)
    with caplog.at_level(logging.WARNING), ddiloco.session(again, restored, hub=shared, learner_id=0, inner_steps=8,
                                                           run_dir=tmp_path):
        assert (restored.param_groups[0]["lr"], restored.param_groups[0]["weight_decay"]) == (2e-3, 0.01)
    [warning] = [r.getMessage() for r in caplog.records if "hyperparameters" in r.getMessage()]
    assert "group 0: lr 1e-05 -> 0.002, weight_decay 0.5 -> 0.01" in warning, warning
    assert "optimizer.param_groups" in warning, warning  # what to do to change them


def test_a_restarted_script_with_the_same_settings_or_a_schedule_hears_nothing_of_them(tmp_path, caplog):
    # A schedule's rate at the checkpoint differs from the rate a new optimizer starts with: that is the schedule's.
    shared, model = hub(), TinyNet(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=8, run_dir=tmp_path,
                         state={"schedule": schedule}) as sync:
        batches = iter(make_batches(8, seed=0))
        while not sync.done:
            sync.step(tokens=train_step(model, optimizer, next(batches)))
            schedule.step()
    again = TinyNet(seed=1)
    restored = torch.optim.AdamW(again.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(restored, lambda step: 1 / (1 + step))
    with caplog.at_level(logging.WARNING), ddiloco.session(again, restored, hub=shared, learner_id=0, inner_steps=8,
                                                           run_dir=tmp_path, state={"schedule": schedule}):
        assert restored.param_groups[0]["lr"] < 2e-3
    assert not [r.getMessage() for r in caplog.records if "hyperparameters" in r.getMessage()]


def test_a_learner_taking_the_runs_position_without_a_checkpoint_says_its_state_starts_afresh(tmp_path, caplog):
    # Nothing was said: a OneCycleLR in state= warmed up again from 0 at the run's position.
    shared = hub()
    ahead = TinyNet(seed=1)
    train(shared, ahead, torch.optim.SGD(ahead.parameters(), lr=0.1), None, inner_steps=12)
    late = TinyNet(seed=1)
    optimizer = torch.optim.SGD(late.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), ddiloco.session(late, optimizer, hub=shared, learner_id=1, inner_steps=40,
                                                           run_dir=tmp_path, state={"data": Counter()}) as sync:
        position = sync.inner_step
    assert position > 0
    warnings = [r.getMessage() for r in caplog.records if "start afresh" in r.getMessage()]
    assert len(warnings) == 1 and f"inner step {position}" in warnings[0] and "'data'" in warnings[0]
    assert "sync.inner_step" in warnings[0]


def test_a_learner_starting_at_the_beginning_says_nothing_about_its_state(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        model = TinyNet(seed=1)
        train(hub(), model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path, inner_steps=4,
              state={"data": Counter()})
    assert "start afresh" not in caplog.text


def test_the_built_in_learners_scheduled_rate_restored_from_its_checkpoint_is_not_called_a_change(tmp_path, caplog):
    # Every resume of the built-in learner warned `the optimizer's hyperparameters come back as saved, not as this
    # script set them (group 0: lr 0.003 -> 0.00025)`: its rate is set each step by its schedule (`apply_inner_lr`).
    from ddiloco.training import InnerConfig, apply_inner_lr, make_inner_optimizer

    inner = InnerConfig(lr=3e-3, warmup_steps=100)
    shared, model = hub(), TinyNet(seed=1)
    optimizer = make_inner_optimizer(model, inner)
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=8, run_dir=tmp_path) as sync:
        batches = iter(make_batches(8, seed=0))
        while not sync.done:
            apply_inner_lr(optimizer, inner, sync.inner_step, 8)
            sync.step(tokens=train_step(model, optimizer, next(batches)))
    again = TinyNet(seed=1)
    restored = make_inner_optimizer(again, inner)
    with caplog.at_level(logging.WARNING), ddiloco.session(again, restored, hub=shared, learner_id=0, inner_steps=8,
                                                           run_dir=tmp_path):
        assert restored.param_groups[0]["lr"] == 3e-3 * 8 / 100  # the schedule's rate at the checkpoint
    assert not [r.getMessage() for r in caplog.records if "hyperparameters" in r.getMessage()]
