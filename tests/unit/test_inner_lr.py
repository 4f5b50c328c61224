"""The inner learning rate's schedule (`ddiloco.training.inner_lr`): a linear warm-up over its first steps, constant,
then linear to 0 over the run's end."""

import pytest
import torch

from ddiloco.sim.cluster import ClusterConfig
from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig
from ddiloco.training import InnerConfig, apply_inner_lr, inner_lr
from tests.helpers import tiny_sim_workload

torch.set_num_threads(1)


def test_the_rate_is_constant_then_falls_linearly_over_the_last_share_of_the_steps():
    config = InnerConfig(lr=1e-3, warmup_steps=0, cooldown=0.2)
    rates = [inner_lr(config, step, 100) for step in range(100)]
    assert rates[:81] == [1e-3] * 81  # step 80 has 20 steps left: the full rate, the decay's first point
    assert rates[90] == pytest.approx(0.5e-3) and rates[99] == pytest.approx(1e-3 / 20)
    assert all(a > b for a, b in zip(rates[80:-1], rates[81:], strict=True))
    assert inner_lr(config, 130, 100) == pytest.approx(1e-3 / 20)  # past the end: the last step's rate


def test_the_warm_up_climbs_linearly_to_the_rate_over_its_steps_whatever_the_budget():
    config = InnerConfig(lr=1e-3, warmup_steps=10, cooldown=0.2)
    for budget in (100, 10**9):  # a chaos run's budget is unbounded: the warm-up still ends at step 10
        rates = [inner_lr(config, step, budget) for step in range(12)]
        assert rates[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
        assert rates[9:] == [1e-3] * 3


def test_a_warm_up_that_reaches_into_the_cooldown_takes_the_lower_rate():
    config = InnerConfig(lr=1e-3, warmup_steps=8, cooldown=0.5)
    assert inner_lr(config, 6, 10) == pytest.approx(min(1e-3 * 7 / 8, 1e-3 * 4 / 5))
    assert inner_lr(config, 1, 10) == pytest.approx(1e-3 * 2 / 8)


def test_a_negative_warm_up_is_refused_by_name():
    with pytest.raises(ValueError, match="warmup_steps=-1 is invalid"):
        InnerConfig(warmup_steps=-1)


def test_no_cooldown_keeps_the_rate_everywhere_even_past_the_end():
    config = InnerConfig(lr=1e-3, warmup_steps=0, cooldown=0.0)
    assert {inner_lr(config, step, 10) for step in (0, 9, 10, 50)} == {1e-3}


def test_a_cooldown_outside_the_run_is_refused_by_name():
    with pytest.raises(ValueError, match="cooldown=1.5 is invalid"):
        InnerConfig(cooldown=1.5)
    with pytest.raises(ValueError, match="cooldown=-0.1 is invalid"):
        InnerConfig(cooldown=-0.1)


def test_every_parameter_group_gets_the_rate():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-3)
    apply_inner_lr(optimizer, InnerConfig(lr=1e-3, warmup_steps=0, cooldown=0.5), 9, 10)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(1e-3 / 5)] * 2


def test_the_harness_learners_end_the_run_cooled_down():
    workload = tiny_sim_workload(inner_steps=20)
    sim = DecoupledSim(DecoupledSimConfig(workload=workload, cluster=ClusterConfig(num_learners=2)))
    sim.run()
    last = [slot.learner.optimizer.param_groups[0]["lr"] for slot in sim.slots]
    # The token budget's last steps (each learner's last of 20): lr / (0.2 x 20) after the other's claim.
    assert all(0 < lr <= workload.inner.lr / 2 for lr in last), last
