"""The harness's loss curve ends with the run's final evaluation once: a periodic evaluation at the budget's last
mark and the final one after the last rounds shared their tokens and time, two points one above the other (a vertical
step at the end of every plot, and for Decoupled two different losses at one moment). Every quick experiment's curves
are checked in tests/integration/test_experiments_quick.py."""

from __future__ import annotations

from ddiloco.sim.accounting import CurvePoint, add_final_point


def test_the_final_evaluation_replaces_a_periodic_one_at_the_same_moment_and_follows_an_earlier_one():
    curve = [CurvePoint(10, 1.0, 3.0), CurvePoint(20, 2.0, 2.5)]
    add_final_point(curve, CurvePoint(20, 2.0, 2.4))
    assert curve == [CurvePoint(10, 1.0, 3.0), CurvePoint(20, 2.0, 2.4)]
    add_final_point(curve, CurvePoint(20, 2.5, 2.3))  # later: the last rounds closed after the last mark
    assert curve[-2:] == [CurvePoint(20, 2.0, 2.4), CurvePoint(20, 2.5, 2.3)]

