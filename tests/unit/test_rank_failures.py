"""Which rank of a learner of several ranks is named for its failure (`ddiloco.rank_failures`)."""

from __future__ import annotations

import os

from ddiloco.checkpoint import atomic_write_json
from ddiloco.rank_failures import RANKS_FILE, first_failed, record


def test_the_earliest_failure_while_every_peer_lived_is_named_and_an_explaining_error_before_it(tmp_path):
    atomic_write_json(tmp_path / RANKS_FILE, {"ranks": [os.getpid(), os.getpid()]})  # both alive (this process)
    record(tmp_path, 1)  # a "connection closed by peer" in DDP's all-reduce, recorded first
    assert first_failed(tmp_path, [0, 1]) == 1
    # Rank 0's RanksOutOfStepError (it left its loop alone, and its barrier timed out): the error that says what
    # broke. Its timed-out barrier closed its connections a few milliseconds before it could record: rank 1 was named,
    # with its "connection closed".
    record(tmp_path, 0, explains=True)
    assert first_failed(tmp_path, [0, 1]) == 0


def test_without_records_a_rank_that_recorded_nothing_is_named_before_one_that_failed_after_a_death(tmp_path):
    atomic_write_json(tmp_path / RANKS_FILE, {"ranks": [os.getpid(), 2**22 + 12345]})  # rank 1's pid: gone
    record(tmp_path, 0)  # failed after its peer died: a consequence
    assert first_failed(tmp_path, [0, 1]) == 1  # rank 1 recorded nothing: killed by a signal
