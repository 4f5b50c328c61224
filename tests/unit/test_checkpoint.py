"""Durable files: atomic writes, state checkpoints, the round log, and restoring a syncer from them."""

import json
import logging

import pytest
import torch
from safetensors.torch import load as load_safetensors

from ddiloco.checkpoint import (
    KEEP_STATES,
    atomic_write_json,
    bytes_checksum,
    load_latest_state,
    load_tensors,
    read_json,
    save_state,
    save_tensors,
)
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.round_log import RoundLog
from ddiloco.runtime.syncer_standby import LogFollower
from ddiloco.runtime.syncer_state import (
    GENESIS_FILE,
    GenesisRecord,
    SyncerStore,
    read_genesis,
    replay_onto,
    write_genesis,
)
from ddiloco.state_tree import join_state, split_state
from ddiloco.syncer import Syncer, replay_rounds
from tests.helpers import TinyNet, committed_rounds, flip_bit_in_tensor_data, make_batches, params_of, train_step


def _adamw_after_steps(seed: int = 0, steps: int = 3):
    model = TinyNet(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for batch in make_batches(steps, seed=seed):
        train_step(model, optimizer, batch)
    return model, optimizer


def test_atomic_json_leaves_no_temporary_files(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    atomic_write_json(tmp_path / "a.json", {"x": 2}, durable=False)
    assert read_json(tmp_path / "a.json") == {"x": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert read_json(tmp_path / "missing.json") is None


def test_split_and_join_keep_int_keys_tuples_and_tensors():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
             "param_groups": [{"betas": (0.9, 0.95), "params": [0], "fused": None, "amsgrad": False}]}
    tensors, tree = split_state(state)
    assert set(tensors) == {"/state/0/step", "/state/0/exp_avg"}
    back = join_state(json.loads(json.dumps(tree)), tensors)
    assert back["param_groups"] == state["param_groups"]
    assert list(back["state"]) == [0]
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_split_state_refuses_objects_it_cannot_store():
    with pytest.raises(TypeError, match="object"):
        split_state({"x": object()})


def test_optimizer_state_round_trips_bit_for_bit(tmp_path):
    model, optimizer = _adamw_after_steps()
    save_state(tmp_path, {"optimizer": optimizer.state_dict(), "cursor": {"batches": 3}}, serial=3, meta={"k": 1})
    state, meta, serial = load_latest_state(tmp_path)
    assert (serial, meta, state["cursor"]) == (3, {"k": 1}, {"batches": 3})

    twin = TinyNet(seed=0)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.95))
    twin_optimizer.load_state_dict(state["optimizer"])
    batch = make_batches(1, seed=99)[0]
    train_step(model, optimizer, batch)
    train_step(twin, twin_optimizer, batch)
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_only_the_newest_states_are_kept_and_a_damaged_newest_falls_back(tmp_path):
    for serial in range(5):
        save_state(tmp_path, {"x": torch.full((2,), float(serial))}, serial=serial)
    assert len(list(tmp_path.glob("state_*.json"))) == KEEP_STATES
    state, _, serial = load_latest_state(tmp_path)
    assert serial == 4 and state["x"].tolist() == [4.0, 4.0]
    (tmp_path / "state_000000004.safetensors").write_bytes(b"torn")
    state, _, serial = load_latest_state(tmp_path)
    assert serial == 3 and state["x"].tolist() == [3.0, 3.0]
    assert load_latest_state(tmp_path / "nothing") is None


def test_round_log_round_trips_and_repairs_a_torn_line(tmp_path):
    config = DilocoConfig(num_fragments=2, sync_every=4)
    _, records = committed_rounds(4, config)
    log = RoundLog(tmp_path)
    for record in records:
        log.append(record)
    with log.path.open("a") as file:
        file.write('{"round": 4, "frag')  # a crash in the middle of an append
    assert len(log.lines()) == len(records)
    assert log.repair() == len(records)
    assert log.path.read_bytes().endswith(b"\n")
    back = list(log.records())
    assert [r.to_json() for r in back] == [r.to_json() for r in records]
    for a, b in zip(back, records, strict=True):
        assert all(torch.equal(a.merged[n], b.merged[n]) for n in b.merged)


def test_round_log_refuses_a_gap(tmp_path):
    config = DilocoConfig(num_fragments=2, sync_every=4)
    _, records = committed_rounds(3, config)
    log = RoundLog(tmp_path)
    log.append(records[0])
    log.append(records[2])
    with pytest.raises(ValueError, match="damaged"):
        list(log.records())


def test_store_restores_state_plus_replayed_rounds_bit_for_bit(tmp_path):
    """A full state at round 3 plus the log's rounds 3.. gives exactly the live syncer's state."""
    config = DilocoConfig(num_fragments=2, sync_every=4)
    live, records = committed_rounds(9, config)
    initial = params_of(TinyNet(seed=100))  # make_system's syncer seed

    store = SyncerStore(tmp_path)
    partial = Syncer(config, QuorumConfig(), initial_params=initial)
    replay_onto(partial, records[:3])
    store.save(partial, {"joins": {"0": 1}})
    for record in records:
        store.commit(record)

    restored_syncer = Syncer(config, QuorumConfig(), initial_params=initial)
    restored = store.restore(restored_syncer)
    assert (restored.state_rounds, restored.replayed, restored.meta) == (3, len(records) - 3, {"joins": {"0": 1}})
    assert restored_syncer.rounds_committed == live.rounds_committed
    assert restored_syncer.versions == live.versions
    expected = live.global_params()
    got = restored_syncer.global_params()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert all(torch.equal(got[n], t) for n, t in replay_rounds(config, initial, records).items())
    live_outer, restored_outer = live.outer.state_dict(), restored_syncer.outer.state_dict()
    for a, b in zip(live_outer, restored_outer, strict=True):
        for index, slot in a["state"].items():
            assert torch.equal(slot["momentum_buffer"], b["state"][index]["momentum_buffer"])
    assert {i: info.merged_base for i, info in restored_syncer.learners.items()} == \
        {i: info.merged_base for i, info in live.learners.items()}
    reads = []
    numbered = store.log.numbered
    store.log.numbered = lambda: reads.append(1) or numbered()
    participation = store.participation(live.fragment_shares)
    assert reads == []  # what the restore counted: a syncer's start parsed the whole log twice (until 2026-12-07)
    assert store.participation(live.fragment_shares) == participation and reads == [1]  # later: read afresh
    assert participation[0]["accepted"] == live.learners[0].accepted
    # Each token counted once, not once per fragment: tokens x the fragment's share of the model, summed.
    shares = live.fragment_shares
    assert participation[0]["tokens_merged"] == pytest.approx(sum(
        p.tokens * shares[r.fragment] for r in records for p in r.participants if p.learner_id == 0))
    assert sum(shares) == pytest.approx(1.0) and len(shares) == 2


def test_replay_refuses_a_round_that_does_not_continue_the_state():
    config = DilocoConfig(num_fragments=2, sync_every=4)
    _, records = committed_rounds(3, config)
    syncer = Syncer(config, QuorumConfig(), initial_params=params_of(TinyNet(seed=100)))
    with pytest.raises(ValueError, match="round log has round 1 where 0 was expected"):
        replay_onto(syncer, records[1:])


# ---- checksums: a flipped bit on disk is refused, never loaded -------------------------------------------------

def test_the_checksum_is_crc32():
    # The CRC-32 check value: the CRC of the ASCII digits "123456789" is 0xCBF43926 (ISO 3309, as in zlib).
    assert bytes_checksum(b"123456789") == "crc32:cbf43926"
    assert bytes_checksum(b"") == "crc32:00000000"
    assert bytes_checksum(b"1234", memoryview(b"56789")) == bytes_checksum(b"123456789")  # parts, in order


def test_a_flipped_bit_in_the_newest_state_falls_back_to_the_older_one(tmp_path, caplog):
    for serial in (3, 4):
        save_state(tmp_path, {"x": torch.full((2,), float(serial))}, serial=serial)
    flip_bit_in_tensor_data(tmp_path / "state_000000004.safetensors")
    with caplog.at_level(logging.ERROR, logger="ddiloco.checkpoint"):
        state, _, serial = load_latest_state(tmp_path)
    assert serial == 3 and state["x"].tolist() == [3.0, 3.0]
    assert "state_000000004.json is damaged" in caplog.text and "checksum" in caplog.text

    flip_bit_in_tensor_data(tmp_path / "state_000000003.safetensors")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ddiloco.checkpoint"):
        assert load_latest_state(tmp_path) is None
    assert "no readable state" in caplog.text


def test_a_state_without_a_checksum_is_not_loaded(tmp_path):
    """States written before checksums were recorded: treated as damaged (this schema cannot resume them)."""
    path = save_state(tmp_path, {"x": torch.ones(2)}, serial=1)
    record = json.loads(path.read_text())
    record.pop("tensors_checksum", None)
    atomic_write_json(path, record)
    assert load_latest_state(tmp_path) is None


def _committed(tmp_path, rounds: int, config: DilocoConfig):
    live, records = committed_rounds(rounds, config)
    store = SyncerStore(tmp_path)
    for record in records:
        store.commit(record)
    return live, records, store


def test_a_flipped_bit_in_a_rounds_tensors_is_refused_naming_the_round(tmp_path):
    """Round 2's merged pseudo-gradient loses one bit on disk: replaying the log (a restore, an export, the
    chaos invariants) refuses and names the round and its file, rather than rebuild another global state."""
    config = DilocoConfig(num_fragments=2, sync_every=4)
    _, records, store = _committed(tmp_path, 4, config)
    damaged = store.log.tensors_path(2)
    flip_bit_in_tensor_data(damaged)
    read_back = load_safetensors(damaged.read_bytes())
    assert any(not torch.equal(read_back[n], t) for n, t in records[2].merged.items())  # the flip is in the data

    syncer = Syncer(config, QuorumConfig(), initial_params=params_of(TinyNet(seed=100)))
    with pytest.raises(ValueError, match=r"round 2 is damaged .*round_000002\.safetensors.*from a backup"):
        store.restore(syncer)
    with pytest.raises(ValueError, match="round 2 is damaged"):
        list(store.log.records())
    assert [r.round_index for r in store.log.records(start=3)] == [3]  # rounds a replay does not read are not read
    with pytest.raises(ValueError, match="round 2 is damaged"):  # a standby syncer following the log
        LogFollower(store.log).new_records(after=0)


def test_a_round_line_without_a_checksum_is_refused(tmp_path):
    """A round log written before checksums: refused with the reason, never replayed unchecked."""
    config = DilocoConfig(num_fragments=2, sync_every=4)
    _, _, store = _committed(tmp_path, 2, config)
    lines = store.log.lines()
    lines[1].pop("tensors_checksum", None)
    store.log.path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match="round 1 records no checksum"):
        list(store.log.records())


def test_a_syncer_whose_newest_full_state_is_damaged_restores_from_the_older_one(tmp_path):
    """The newest full state (round 6) loses a bit: the store loads the one at round 3 and replays rounds 3-8,
    reaching exactly the live syncer's state."""
    config = DilocoConfig(num_fragments=2, sync_every=4)
    live, records, store = _committed(tmp_path, 9, config)
    initial = params_of(TinyNet(seed=100))
    partial = Syncer(config, QuorumConfig(), initial_params=initial)
    replay_onto(partial, records[:3])
    store.save(partial, {})
    replay_onto(partial, records[3:6])
    store.save(partial, {})
    flip_bit_in_tensor_data(store.state_dir / "state_000000006.safetensors")

    restored_syncer = Syncer(config, QuorumConfig(), initial_params=initial)
    restored = store.restore(restored_syncer)
    assert (restored.state_rounds, restored.replayed) == (3, 6)
    expected, got = live.global_params(), restored_syncer.global_params()
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_a_flipped_bit_in_the_genesis_is_refused(tmp_path):
    params = params_of(TinyNet(seed=100))
    write_genesis(tmp_path, GenesisRecord(params, ("token_embedding.weight",), "test"))
    back = read_genesis(tmp_path)
    assert back is not None and all(torch.equal(back.params[n], t) for n, t in params.items())
    path = tmp_path / GENESIS_FILE
    intact = path.read_bytes()
    flip_bit_in_tensor_data(path)
    with pytest.raises(ValueError, match=r"genesis\.safetensors is damaged \(.*checksum.*\): restore it from a backup"):
        read_genesis(tmp_path)

    # A flip in the header's metadata (the source "test" read as "tesu") is refused too.
    at = intact.index(b'"test"') + 4
    path.write_bytes(intact[:at] + bytes([intact[at] ^ 0x01]) + intact[at + 1:])
    with pytest.raises(ValueError, match=r"genesis\.safetensors is damaged \(the checksum of its tensor data and meta"):
        read_genesis(tmp_path)


def test_a_missing_genesis_beside_committed_rounds_is_refused_never_a_fresh_start(tmp_path):
    # A resume without genesis.safetensors started afresh: a new genesis, round 0 appended after the old log's
    # round 28, the old round files overwritten; the run could neither be resumed nor exported after.
    assert read_genesis(tmp_path) is None  # a new run: no genesis yet, nothing else either
    _, _, store = _committed(tmp_path, 3, DilocoConfig(num_fragments=2, sync_every=4))
    (tmp_path / GENESIS_FILE).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"genesis\.safetensors is missing, but the run has committed rounds "
                                         r"\(rounds\.jsonl is not empty\): restore it from a backup"):
        read_genesis(tmp_path)
    store.log.path.write_bytes(b"")
    store.save(Syncer(DilocoConfig(num_fragments=2, sync_every=4), QuorumConfig(),
                      initial_params=params_of(TinyNet(seed=100))), {})
    with pytest.raises(ValueError, match=r"is missing, but the run has syncer states in checkpoints/syncer"):
        read_genesis(tmp_path)


def test_tensors_alone_in_their_memory_are_written_without_a_copy_and_shared_ones_with_one(tmp_path, monkeypatch):
    flat = torch.arange(12, dtype=torch.float32)
    alone = {"moment": torch.randn(3, 4), "step": torch.tensor(5.0), "count": torch.tensor([7], dtype=torch.int64)}
    shared = {"first": flat[:6], "second": flat[6:].view(2, 3), "again": alone["moment"],
              "column": torch.randn(4, 3).t(), "empty": torch.zeros(0)}
    copies = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: copies.append(self.shape) or clone(self, *a, **k))
    checksum = save_tensors(tmp_path / "t.safetensors", {**alone, **shared})
    # The views of one buffer (safetensors refuses shared memory) and the second name of a tensor are copied, and so
    # is the empty one; a transposed tensor is made contiguous, which copies it already.
    assert sorted(copies) == sorted([flat[:6].shape, flat[6:].view(2, 3).shape, alone["moment"].shape, (0,)])
    back = load_tensors(tmp_path / "t.safetensors", checksum=checksum)
    assert all(torch.equal(back[name], tensor) for name, tensor in {**alone, **shared}.items())
