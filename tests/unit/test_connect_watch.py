"""When a learner that cannot reach its syncer says so, and when it gives up (`ConnectWatch`, time passed in)."""

from __future__ import annotations

import itertools

from ddiloco.transport.grpc_client import UNREACHABLE_WARN_AFTER, UNREACHABLE_WARN_EVERY_S, ConnectWatch

ADDRESS = "10.1.2.3:50051"
ERROR = "UNAVAILABLE: failed to connect to all addresses"


def test_it_warns_after_the_first_failed_attempts_then_at_a_bounded_rate():
    watch = ConnectWatch(ADDRESS, connect_timeout_s=0.0, started_at=0.0)
    verdicts = [watch.failed(0.1 * (i + 1), ERROR) for i in range(UNREACHABLE_WARN_AFTER)]
    assert [v.warning is not None for v in verdicts] == [False] * (UNREACHABLE_WARN_AFTER - 1) + [True]
    first = verdicts[-1].warning
    assert ADDRESS in first and ERROR in first
    # One attempt every 2 s (the backoff's cap) for 80 s: one more line every UNREACHABLE_WARN_EVERY_S, no more.
    warned = [0.1 * UNREACHABLE_WARN_AFTER]
    for i in range(40):
        now = warned[0] + 1.0 + 2.0 * i
        if (line := watch.failed(now, ERROR).warning) is not None:
            assert ADDRESS in line and ERROR in line
            warned.append(now)
    gaps = [later - earlier for earlier, later in itertools.pairwise(warned)]
    assert len(warned) == 3 and all(UNREACHABLE_WARN_EVERY_S <= gap < UNREACHABLE_WARN_EVERY_S + 2.0 for gap in gaps)


def test_it_gives_up_once_the_syncer_never_answered_for_the_timeout():
    watch = ConnectWatch(ADDRESS, connect_timeout_s=10.0, started_at=100.0)
    assert all(watch.failed(100.0 + t, ERROR).give_up is None for t in (0.1, 0.3, 0.7, 1.5, 3.1, 5.1, 7.1, 9.1))
    give_up = watch.failed(111.1, ERROR).give_up
    assert give_up is not None
    assert ADDRESS in give_up and "10 s" in give_up and ERROR in give_up and "connect_timeout_s" in give_up


def test_a_timeout_of_zero_waits_forever():
    watch = ConnectWatch(ADDRESS, connect_timeout_s=0.0, started_at=0.0)
    assert all(watch.failed(t, ERROR).give_up is None for t in (1.0, 1e3, 1e6))


def test_a_learner_that_reached_the_syncer_once_retries_forever_and_warns_afresh():
    # A syncer restarted mid-run: the learners that had joined must come back to it, however long it takes.
    watch = ConnectWatch(ADDRESS, connect_timeout_s=10.0, started_at=0.0)
    watch.failed(0.1, ERROR)
    watch.reached()
    verdicts = [watch.failed(50.0 + i, ERROR) for i in range(UNREACHABLE_WARN_AFTER)]
    assert all(v.give_up is None for v in verdicts)
    assert [v.warning is not None for v in verdicts] == [False] * (UNREACHABLE_WARN_AFTER - 1) + [True]
    assert "lost the syncer" in verdicts[-1].warning and ADDRESS in verdicts[-1].warning
    assert watch.failed(1e6, ERROR).give_up is None
