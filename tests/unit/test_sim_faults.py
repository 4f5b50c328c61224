"""Fault plans, the failure model, and seeded models of the virtual-time harness."""

import math
import sys

import numpy as np
import pytest
import torch

from ddiloco.failures import FailureModel
from ddiloco.fault_plan import Fault, outage
from ddiloco.plan.failures import sample_recovery_s
from ddiloco.sim.faults import HARNESS_FAILURES, FaultPlan, draw_fault_plan, harness_failures, harness_plan


def test_fault_plan_sorts_queries_and_refuses_overlaps():
    plan = FaultPlan.of([(1, 10.0, 20.0), (0, 5.0, 6.0), (1, 30.0, 31.0)])
    assert [o.at_s for o in plan.outages] == [5.0, 10.0, 30.0]
    assert plan.is_down(1, 10.0) and plan.is_down(1, 19.9) and not plan.is_down(1, 20.0)
    assert plan.down_s(1, until_s=15.0) == pytest.approx(5.0)
    assert plan.down_s(1, until_s=100.0) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="overlap"):
        FaultPlan.of([(2, 0.0, 10.0), (2, 5.0, 6.0)])
    with pytest.raises(ValueError, match="end_s"):
        outage(0, 3.0, 2.0)


def test_the_harness_runs_the_chaos_plan_type_restricted_to_outages():
    # One type: an outage is a crash held down; a chaos plan of outages runs in the harness as it is.
    plan = FaultPlan(duration_s=60.0, num_learners=2,
                     faults=(Fault(at_s=5.0, kind="crash", target=1, restart=False, duration_s=4.0),))
    assert harness_plan(plan, 2) == plan and plan.is_down(1, 8.9) and not plan.is_down(1, 9.0)
    assert FaultPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="latency are invalid for the harness"):
        harness_plan(FaultPlan(faults=(Fault(at_s=1.0, kind="latency", target=0, duration_s=2.0, value=0.1),)), 2)
    with pytest.raises(ValueError, match="crash with restart true are invalid for the harness"):
        harness_plan(FaultPlan(faults=(Fault(at_s=1.0, kind="crash", target=0),)), 2)
    with pytest.raises(ValueError, match="beyond num_learners=2"):
        harness_plan(FaultPlan.of([(2, 1.0, 2.0)]), 2)


def test_drawn_fault_plans_are_seeded_and_keep_someone_alive():
    model = harness_failures(mtbi_s=50.0, recovery_scale_s=20.0)
    a = draw_fault_plan(model, num_learners=4, horizon_s=1000.0, seed=7)
    assert a == draw_fault_plan(model, num_learners=4, horizon_s=1000.0, seed=7)
    assert a != draw_fault_plan(model, num_learners=4, horizon_s=1000.0, seed=8)
    assert a.outages and all(o.at_s < 1000.0 for o in a.outages)
    for t in np.arange(0.0, 1200.0, 0.5):
        assert sum(a.is_down(m, t) for m in range(4)) <= 3


def test_recovery_times_follow_the_exponentiated_weibull_quantiles():
    model = FailureModel(recovery_scale_s=20.0, recovery_shape=0.8, recovery_exponent=1.5, max_recovery_s=1e9)
    rng = np.random.default_rng(0)
    draws = np.array([model.sample_recovery_s(rng) for _ in range(20_000)])
    # F(x) = (1 - exp(-(x / scale)^k))^alpha, so the median solves F = 1/2.
    median = 20.0 * (-math.log1p(-(0.5 ** (1 / 1.5)))) ** (1 / 0.8)
    assert np.median(draws) == pytest.approx(median, rel=0.03)
    capped = harness_failures(max_recovery_s=5.0)
    assert max(capped.sample_recovery_s(rng) for _ in range(1000)) <= 5.0


def test_the_planner_and_the_harness_draw_recoveries_from_one_model():
    # One class, one sampler: the harness's draws one at a time are the planner's vector draws, bit for bit,
    # and both are the inversion formula capped at the harness's 300 s.
    rng = np.random.default_rng(3)
    one_by_one = [HARNESS_FAILURES.sample_recovery_s(rng) for _ in range(500)]
    assert one_by_one == list(sample_recovery_s(np.random.default_rng(3), 500, HARNESS_FAILURES))
    u = np.random.default_rng(3).random(500)
    by_hand = [min(10.0 * (-math.log1p(-(x ** (1 / 1.5)))) ** (1 / 0.8), 300.0) for x in u]
    # The sampler computes with NumPy's vectorised log1p and power, by_hand with the C library's: the two may
    # differ in their last bits, a few ulps once the powers amplify a rounding (numpy 2.4.6 against glibc: at most
    # 1.4e-15 relative in these 500 draws), which a wrong formula would exceed by many orders of magnitude.
    assert one_by_one == pytest.approx(by_hand, rel=100 * sys.float_info.epsilon, abs=0.0)
    assert isinstance(HARNESS_FAILURES, FailureModel) and FailureModel().max_recovery_s is None


def test_torch_generator_is_untouched_by_seeded_models():
    from ddiloco.model import ModelConfig
    from ddiloco.sim.workload import seeded_model

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = seeded_model(ModelConfig(width=16, num_heads=2, context_len=16), 5)
    b = seeded_model(ModelConfig(width=16, num_heads=2, context_len=16), 5)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
