"""`ddiloco export` only reads the run directory. A torn last line of `rounds.jsonl` (a syncer appending while the
export reads it, or one killed mid-append) is skipped, not cut: export once truncated it, which on a live run could
cut a round the syncer had just committed. Round files the syncer removes while the export (or a standby syncer)
reads are read again from the newer full state."""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from safetensors.torch import load_file

from ddiloco.cli import main
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_state import GenesisRecord, SyncerStore, write_genesis
from ddiloco.syncer import replay_rounds
from tests.helpers import TinyNet, committed_rounds, params_of

SYNCER_SEED = 100
"""make_system's syncer seed: the genesis the committed rounds start from."""


def digest(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def new_run(tmp_path):
    """A run directory with its config.json (2 fragments, H = 4) and genesis: (run_dir, config, initial, genesis)."""
    run_config = RunConfig()
    config = dataclasses.replace(run_config.diloco, num_fragments=2, sync_every=4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dataclasses.replace(run_config, diloco=config).save(run_dir / "config.json")
    initial = params_of(TinyNet(seed=SYNCER_SEED))
    genesis = GenesisRecord(initial, ("token_embedding.weight",), "a test")
    write_genesis(run_dir, genesis)
    return run_dir, config, initial, genesis


def test_export_leaves_a_torn_round_log_byte_for_byte_and_exports_the_rounds_before_it(tmp_path, capsys):
    run_dir, config, initial, _ = new_run(tmp_path)
    _, records = committed_rounds(3, config, syncer_seed=SYNCER_SEED)
    store = SyncerStore(run_dir)
    for record in records:
        store.commit(record)
    with store.log.path.open("a") as file:
        file.write('{"round": 3, "frag')  # the syncer is in the middle of appending round 3
    before = digest(run_dir)

    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "after 3 rounds" in capsys.readouterr().out
    assert digest(run_dir) == before
    exported = load_file(out)
    expected = replay_rounds(config, initial, records)
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())


def pruned_run(tmp_path, monkeypatch):
    """A run of 8 rounds whose syncer wrote full states at rounds 2, 4 and 6 and so removed the files of rounds 0-3,
    read by a reader that loaded the state at round 2 just before (`load_latest_state` gives it once, then the newest);
    (run_dir, config, initial parameters, records, the calls to load_latest_state)."""
    from ddiloco.config import QuorumConfig
    from ddiloco.runtime import syncer_state

    run_dir, config, initial, genesis = new_run(tmp_path)
    _, records = committed_rounds(8, config, syncer_seed=SYNCER_SEED)
    store, syncer, stale = SyncerStore(run_dir), genesis.syncer(config, QuorumConfig()), None
    for record in records:
        store.commit(record)
        syncer.apply_committed([record])
        if syncer.rounds_committed in (2, 4, 6):
            store.save(syncer, meta={})
        if syncer.rounds_committed == 2:
            stale = syncer_state.load_latest_state(store.state_dir)  # what the reader read, just before ...
    assert not store.log.tensors_path(2).exists()  # ... the states at 4 and 6 held rounds 0-3, and their files went

    real, calls = syncer_state.load_latest_state, []

    def read_before_the_syncer_moved_on(directory):
        calls.append(directory)
        return stale if len(calls) == 1 else real(directory)

    monkeypatch.setattr(syncer_state, "load_latest_state", read_before_the_syncer_moved_on)
    return run_dir, config, initial, records, calls


def test_an_export_racing_a_syncer_that_prunes_rounds_reads_its_newer_state(tmp_path, capsys, monkeypatch):
    # An export of a live run read the newest full state, then the syncer wrote two more and removed the round files
    # after the one read: 5 exports in 2098 failed with "round 239's tensors file ... was removed ... cannot be done
    # in this run directory" (with --full-state-every 2), where the same export a moment later worked.
    run_dir, config, initial, records, calls = pruned_run(tmp_path, monkeypatch)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "after 8 rounds" in capsys.readouterr().out and len(calls) == 2
    exported, expected = load_file(out), replay_rounds(config, initial, records)
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())


def test_a_standby_racing_a_primary_that_prunes_rounds_reads_its_newer_state(tmp_path, monkeypatch):
    # The same race ended a standby syncer (`ddiloco run --standby-syncer`) with that ValueError.
    from types import SimpleNamespace

    from ddiloco.interrupts import StopFlag
    from ddiloco.runtime.syncer_standby import follow_primary

    run_dir, config, initial, records, calls = pruned_run(tmp_path, monkeypatch)
    run_config = dataclasses.replace(RunConfig.load(run_dir / "config.json"), diloco=config)
    lock = SimpleNamespace(try_acquire=iter([False, False, True]).__next__, holder=lambda: 4242)  # gone at the third
    syncer, _ = follow_primary(run_dir, run_config, lock, StopFlag())
    assert syncer.rounds_committed == 8 and len(calls) == 2
    expected = replay_rounds(config, initial, records)
    assert all(torch.equal(syncer.global_params()[name], tensor) for name, tensor in expected.items())


def test_an_export_of_a_run_missing_round_files_is_refused_once_read(tmp_path, capsys):
    # The retry above is for a newer state only: a run directory whose rounds are gone says so (exit 2), at once.
    run_dir, config, _, _ = new_run(tmp_path)
    _, records = committed_rounds(3, config, syncer_seed=SYNCER_SEED)
    store = SyncerStore(run_dir)
    for record in records:
        store.commit(record)
    store.log.tensors_path(1).unlink()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "model.safetensors")]) == 2
    assert "round 1 is damaged (its tensors file" in capsys.readouterr().err
