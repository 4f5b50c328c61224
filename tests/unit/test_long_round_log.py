"""A long run's round log (a line per round: a million rounds of 4 learners is about 800 MB) is read a line at a time
by each of its readers: at a syncer's start, by a standby and by the end-of-run summary: each held every line, the text
and its objects (200 k rounds of 4 learners: 8.6 s and 1.27 GB at a syncer's start, a probe; now 2.8 s and the
memory of one line)."""

from __future__ import annotations

import json
import tracemalloc

from ddiloco.runtime.report import round_totals
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.runtime.syncer_standby import LogFollower
from ddiloco.runtime.syncer_state import SyncerStore

ROUNDS = 5_000


def write_log(run_dir) -> int:
    """ROUNDS lines of 4 participants each, 4 fragments; a torn last line. Returns the log's size in bytes."""
    participant = {"base_version": 0, "folded": [], "inner_step": 4, "staleness": 0, "steps": 4, "tokens": 8192,
                   "weight": 16777216.0}
    with (run_dir / "rounds.jsonl").open("w") as file:
        for index in range(ROUNDS):
            line = {"round": index, "fragment": index % 4, "version": index // 4 + 1, "closed_at": 1.0, "grace_s": 0.5,
                    "opened_at": 0.5, "quorum_at": 0.5, "rejections": [], "summed": [0, 1, 2, 3],
                    "tensors_checksum": "crc32:aad99e69",
                    "participants": [{**participant, "learner_id": i} for i in range(4)]}
            file.write(json.dumps(line, sort_keys=True) + "\n")
        file.write('{"round": 200')  # a syncer killed while appending
    return (run_dir / "rounds.jsonl").stat().st_size


def test_every_reader_of_a_long_round_log_holds_one_line_at_a_time(tmp_path):
    size = write_log(tmp_path)
    store = SyncerStore(tmp_path)
    tracemalloc.start()
    try:
        counts = store.participation([0.25] * 4)
        torn = store.log.torn_bytes()
        followed = LogFollower(store.log).new_records(after=ROUNDS)  # every line read, none past `after` to load
        totals = round_totals(RunPaths(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counts == {i: {"accepted": ROUNDS, "tokens_merged": ROUNDS * 8192 * 0.25} for i in range(4)}
    assert torn == len('{"round": 200') and followed == []
    assert totals.committed == ROUNDS and totals.contributed == {i: ROUNDS for i in range(4)}
    assert totals.versions == {p: ROUNDS // 4 for p in range(4)}
    assert peak < size / 20, (peak, size)  # holding the lines' text alone is the size; their objects several times it
    assert store.log.repair() == ROUNDS and store.log.torn_bytes() == 0


def test_a_long_read_of_the_round_log_says_how_far_it_is(tmp_path, caplog):
    # A syncer's start read a million rounds for about 13 s without a word: each READ_PROGRESS_EVERY_S it says so.
    import logging

    from ddiloco.runtime.syncer_state import READ_PROGRESS_EVERY_S

    size = write_log(tmp_path)
    ticks = iter(range(10 * ROUNDS))
    store = SyncerStore(tmp_path, clock=lambda: next(ticks) * READ_PROGRESS_EVERY_S / 1000)  # a line a millisecond
    with caplog.at_level(logging.WARNING, logger="ddiloco.runtime.syncer_state"):
        store.participation([0.25] * 4)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == ROUNDS // 1000, said
    read_mb, size_mb = 1000 * size / ROUNDS / 1e6, size / 1e6
    assert said[0] == f"[syncer] reading the round log: 1000 rounds, {read_mb:.0f} of {size_mb:.0f} MB, 10 s", said[0]
