"""A syncer process that follows another (a restart after a kill -9, a standby's takeover) takes the counters of the
last `syncer_status.json` the previous one wrote where they are ahead of the last full state's: a learner that had
joined three times showed `joins: 0` in summary.json, and the syncer's bytes only those of the last process."""

from __future__ import annotations

from types import SimpleNamespace

from ddiloco.runtime.syncer_tally import SyncerTally

META = {"joins": {"0": 1}, "rejections": {"stale": 5}, "rejected": {"1": 2}, "bytes_received": 1000,
        "bytes_sent": 9000}
"""What the last full state kept."""
STATUS = {"rejections": {"stale": 7, "malformed": 1}, "bytes_received": 4000, "bytes_sent": 30000,
          "learners": {"0": {"joins": 3, "rejected": 0}, "1": {"joins": 2, "rejected": 4}, "x": {"joins": 9}}}
"""What the previous process's status said a second before it died."""


def tally() -> SyncerTally:
    return SyncerTally(META, {}, num_learners=2, refusal_log_period_s=60.0)


def test_the_previous_processs_status_counters_carry_over_where_they_are_ahead():
    counters = tally()
    counters.carry_over(STATUS)
    assert counters.joins == {0: 3, 1: 2}
    assert counters.rejected == {1: 4}
    assert counters.rejections == {"stale": 7, "malformed": 1}
    assert counters.bytes_base == (4000, 30000)


def test_an_older_or_damaged_status_takes_nothing_from_the_full_state():
    counters = tally()
    counters.carry_over({"rejections": {"stale": 2}, "bytes_received": 10, "bytes_sent": "x",
                         "learners": {"0": {"joins": 0}, "1": "torn"}})
    assert counters.joins == {0: 1} and counters.rejections == {"stale": 5} and counters.rejected == {1: 2}
    assert counters.bytes_base == (1000, 9000)
    counters.carry_over({})  # a new run: no status yet
    assert counters.bytes_base == (1000, 9000)


def test_capped_updates_are_counted_per_learner_kept_in_a_full_state_and_carried_over():
    # A learner whose learning rate diverged had 39 updates capped in one run: logs/syncer.log said so, nothing else.
    counters = tally()
    record = SimpleNamespace(participants=(), fragment=0)
    counters.count_commit(record, [1.0], capped=[1])
    counters.count_commit(record, [1.0], capped=[1, 0])
    assert counters.capped == {1: 2, 0: 1} and counters.meta(SimpleNamespace(bytes_received=0, bytes_sent=0))[
        "capped"] == {"1": 2, "0": 1}
    assert SyncerTally({"capped": {"1": 2}}, {}, num_learners=2, refusal_log_period_s=60.0).capped == {1: 2}
    counters.carry_over({"learners": {"1": {"capped": 5}, "0": {"capped": 0}}})
    assert counters.capped == {1: 5, 0: 1}
