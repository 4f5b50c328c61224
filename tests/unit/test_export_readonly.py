"""`ddiloco export` only reads the run directory. A torn last line of `rounds.jsonl` (a syncer appending while the
export reads it, or one killed mid-append) is skipped, not cut: export once truncated it, which on a live run could
cut a round the syncer had just committed."""

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


def test_export_leaves_a_torn_round_log_byte_for_byte_and_exports_the_rounds_before_it(tmp_path, capsys):
    run_config = RunConfig()
    config = dataclasses.replace(run_config.diloco, num_fragments=2, sync_every=4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dataclasses.replace(run_config, diloco=config).save(run_dir / "config.json")
    initial = params_of(TinyNet(seed=SYNCER_SEED))
    write_genesis(run_dir, GenesisRecord(initial, ("token_embedding.weight",), "a test"))
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
