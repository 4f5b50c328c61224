"""Overlapping in-process faults of one kind on one target combine: a partition lasts the union of the partitions
in force, and of several stragglers, latencies, bandwidth caps, drops or corruptions the strongest in force holds."""

from __future__ import annotations

import pytest

from ddiloco.fault_control import ActiveFault, ChaosControl, write_control


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _control(tmp_path, faults, now):
    path = tmp_path / "chaos.json"
    write_control(path, faults)
    clock = Clock(now)
    return ChaosControl(path, clock=clock, refresh_s=0.0), clock


def test_a_short_partition_inside_a_long_one_does_not_end_it(tmp_path):
    control, clock = _control(tmp_path, [ActiveFault("partition", 1020.0), ActiveFault("partition", 1010.0)], 1009.0)
    assert control.partitioned()
    clock.now = 1011.0  # the short one is over, the long one is not
    assert control.partitioned()
    clock.now = 1020.5
    assert not control.partitioned()


@pytest.mark.parametrize(("kind", "weak", "strong", "read"), [
    ("straggler", 2.0, 5.0, ChaosControl.slowdown),
    ("latency", 0.05, 0.2, ChaosControl.extra_latency_s),
    ("bandwidth", 1e7, 1e5, ChaosControl.bandwidth_bytes_per_s),
])
def test_the_strongest_fault_of_a_kind_in_force_holds(tmp_path, kind, weak, strong, read):
    # The strong one listed first, then a weaker one that ends sooner: before, the last listed won.
    control, clock = _control(tmp_path, [ActiveFault(kind, 1020.0, strong), ActiveFault(kind, 1010.0, weak)], 1005.0)
    assert read(control) == strong
    clock.now = 1015.0
    assert read(control) == strong
    # The weak one outlasting the strong one holds once the strong one is over.
    control, clock = _control(tmp_path, [ActiveFault(kind, 1010.0, strong), ActiveFault(kind, 1020.0, weak)], 1005.0)
    assert read(control) == strong
    clock.now = 1015.0
    assert read(control) == weak


@pytest.mark.parametrize("kind", ["drop", "corrupt"])
def test_the_highest_probability_in_force_draws(tmp_path, kind):
    control, _ = _control(tmp_path, [ActiveFault(kind, 1020.0, 1.0), ActiveFault(kind, 1010.0, 0.0)], 1005.0)
    draw = control.should_drop if kind == "drop" else control.should_corrupt
    assert all(draw() for _ in range(20))
