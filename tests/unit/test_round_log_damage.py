"""A damaged `rounds.jsonl` next to an intact full state: a restore (`ddiloco run --resume`, `ddiloco syncer`) and
an export refuse with a message naming the file, the line and the round, and change nothing on disk; only a torn last
line that holds a round the newest state does not (a crash mid-append) is cut, as a restart always did.

Each test builds a run directory by hand: the genesis, four committed rounds and a full state at round 4 (or 2)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.runtime.syncer_state import GenesisRecord, SyncerStore, exported_params, replay_onto, write_genesis
from ddiloco.syncer import Syncer, replay_rounds
from tests.helpers import TinyNet, committed_rounds, params_of

SYNCER_SEED = 100
"""make_system's syncer seed: the genesis the committed rounds start from."""
ROUNDS = 4
CONFIG = DilocoConfig(num_fragments=2, sync_every=4)


@pytest.fixture(scope="module")
def records():
    return committed_rounds(ROUNDS, CONFIG, syncer_seed=SYNCER_SEED)[1]


def run_dir_with(tmp_path, records, *, state_rounds: int = ROUNDS):
    """A run directory holding the genesis, every round of `records` and a full state after `state_rounds`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_genesis(run_dir, GenesisRecord(params_of(TinyNet(seed=SYNCER_SEED)), ("token_embedding.weight",), "a test"))
    store = SyncerStore(run_dir)
    for record in records:
        store.commit(record)
    syncer = fresh_syncer()
    replay_onto(syncer, records[:state_rounds])
    store.save(syncer, {})
    return run_dir, store


def fresh_syncer():
    return Syncer(CONFIG, QuorumConfig(), initial_params=params_of(TinyNet(seed=SYNCER_SEED)))


def digest(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def rewrite_line(store, number: int, raw: bytes | None) -> None:
    """Replace line `number` (1-based) of the round log with `raw`, or delete it (None)."""
    lines = store.log.path.read_bytes().splitlines(keepends=True)
    if raw is None:
        del lines[number - 1]
    else:
        lines[number - 1] = raw + b"\n"
    store.log.path.write_bytes(b"".join(lines))


def refusals(run_dir, store) -> list[str]:
    """What a restarted syncer and an export say, each of which must refuse."""
    messages = []
    with pytest.raises(ValueError) as restore:
        store.restore(fresh_syncer())
    messages.append(str(restore.value))
    with pytest.raises(ValueError) as export:
        exported_params(run_dir, CONFIG)
    messages.append(str(export.value))
    return messages


@pytest.mark.parametrize("raw", [b'{"garbage": tru', b'{"round": 1, \xff\xfe}'], ids=["torn-json", "not-utf8"])
def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path, records, raw):
    run_dir, store = run_dir_with(tmp_path, records)
    rewrite_line(store, 2, raw)
    before = digest(run_dir)
    for message in refusals(run_dir, store):
        assert "rounds.jsonl line 2 is not valid JSON" in message, message
    assert digest(run_dir) == before


def test_a_line_that_is_json_but_no_round_is_named_by_file_and_line(tmp_path, records):
    run_dir, store = run_dir_with(tmp_path, records)
    rewrite_line(store, 3, b'{"garbage": true}')
    for message in refusals(run_dir, store):
        assert "rounds.jsonl line 3 is not a round record" in message, message


def test_a_deleted_middle_line_names_the_missing_round_not_a_short_log(tmp_path, records):
    """Round 1's line is gone: the log holds 3 rounds against a state of 4, which once read as a log whose end was
    lost; the numbering says which round is missing, and where."""
    run_dir, store = run_dir_with(tmp_path, records)
    rewrite_line(store, 2, None)
    before = digest(run_dir)
    for message in refusals(run_dir, store):
        assert "rounds.jsonl line 2 holds round 2 where round 1 should be" in message, message
        assert "holds 3 rounds" not in message
    assert digest(run_dir) == before


def test_a_log_shorter_than_the_state_is_refused_and_says_what_is_missing(tmp_path, records):
    run_dir, store = run_dir_with(tmp_path, records)
    rewrite_line(store, ROUNDS, None)
    for message in refusals(run_dir, store):
        assert "holds rounds 0 to 2 but the syncer state" in message and "has 4" in message, message
        assert "round 3 is missing" in message, message


def test_a_torn_line_of_a_round_the_state_holds_is_refused_and_left_on_disk(tmp_path, records):
    """The last line lost its end, but the newest state holds its round: that is damage, not a crash mid-append
    (a state is written after its rounds are durable). The restore refuses and leaves every byte as it was."""
    run_dir, store = run_dir_with(tmp_path, records)
    data = store.log.path.read_bytes()
    store.log.path.write_bytes(data[:-50])
    before = digest(run_dir)
    for message in refusals(run_dir, store):
        assert "torn last line" in message and "round 3 is missing" in message, message
    assert digest(run_dir) == before


def test_a_torn_line_after_the_state_is_a_crash_mid_append_and_is_cut(tmp_path, records):
    """A state at round 2, rounds 0-3 in the log, then half of round 4's line: the syncer died while appending round
    4, which no learner heard of. A restart cuts it and replays rounds 2-3; an export reads the same without cutting."""
    run_dir, store = run_dir_with(tmp_path, records, state_rounds=2)
    with store.log.path.open("a") as file:
        file.write('{"round": 4, "frag')
    torn = store.log.path.read_bytes()

    params, rounds, _ = exported_params(run_dir, CONFIG)
    assert rounds == ROUNDS and store.log.path.read_bytes() == torn
    syncer = fresh_syncer()
    restored = store.restore(syncer)
    assert (restored.state_rounds, restored.replayed, syncer.rounds_committed) == (2, 2, ROUNDS)
    assert store.log.path.read_bytes() == torn[:torn.rfind(b"\n") + 1]
    expected = replay_rounds(CONFIG, params_of(TinyNet(seed=SYNCER_SEED)), records)
    got = syncer.global_params()
    assert all(torch.equal(got[n], t) and torch.equal(params[n], t) for n, t in expected.items())


def test_a_damaged_round_file_refuses_before_a_torn_line_is_cut(tmp_path, records):
    """Replay fails (round 3's tensors are gone): the torn line after it stays, since the restore was refused."""
    run_dir, store = run_dir_with(tmp_path, records, state_rounds=2)
    with store.log.path.open("a") as file:
        file.write('{"round": 4, "frag')
    store.log.tensors_path(3).unlink()
    before = digest(run_dir)
    with pytest.raises(ValueError, match="round 3 is damaged"):
        store.restore(fresh_syncer())
    assert digest(run_dir) == before


def test_records_names_a_line_whose_fields_are_wrong(tmp_path, records):
    """A line with a round number but a field that is not what a round record holds: named, not a bare KeyError."""
    _, store = run_dir_with(tmp_path, records, state_rounds=0)
    line = store.log.lines()[1]
    line.pop("fragment")
    rewrite_line(store, 2, json.dumps(line).encode())
    with pytest.raises(ValueError, match=r"rounds\.jsonl line 2 .*round 1.*'fragment'"):
        list(store.log.records())



def test_a_standby_following_the_log_names_a_damaged_line_too(tmp_path, records):
    # The standby's follower parsed each new line on its own: a bare "Expecting value: line 1 column 13".
    from ddiloco.runtime.syncer_standby import LogFollower

    run_dir, store = run_dir_with(tmp_path, records)
    rewrite_line(store, 3, b'{"garbage": tru')
    with pytest.raises(ValueError) as refused:
        LogFollower(store.log).new_records(after=0)
    assert str(refused.value) == (f"{store.log.path} line 3 is not valid JSON (Expecting value at column 13): the "
                                  "round log is damaged: restore rounds.jsonl from a backup")
