"""What the syncer keeps of `rounds/`: the tensors files of the rounds a restart may replay, after the older of the
two full states it keeps (`--round-files recent`, the default), or every one (`--round-files all`, which `ddiloco
chaos` audits from the genesis). Before, every round's file was kept for the life of the run: `rounds/` grew by
about 4 x N / H bytes per inner step (167 MB per inner step for 1 B parameters at H = 24), with no way to bound it."""

import functools

import pytest
import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.runtime.syncer_state import SyncerStore, replay_onto
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, committed_rounds, flip_bit_in_tensor_data, params_of

CONFIG = DilocoConfig(num_fragments=2, sync_every=4)
ROUNDS = 12
EVERY = 4
"""A full state every 4 rounds, as the service writes them (at start, then once 4 rounds passed the last)."""


@functools.cache
def _rounds():
    return committed_rounds(ROUNDS, CONFIG)


def _run(run_dir, *, keep_round_files=False):
    """Commit ROUNDS rounds through a store, writing a full state at round 0 and every EVERY rounds; returns the live
    syncer the rounds came from (shared by the tests: read only)."""
    live, records = _rounds()
    store = SyncerStore(run_dir, keep_round_files=keep_round_files)
    shadow = _fresh()
    store.save(shadow, {})
    for record in records:
        store.commit(record)
        replay_onto(shadow, [record])
        if shadow.rounds_committed % EVERY == 0:
            store.save(shadow, {})
    return live


def _fresh() -> Syncer:
    return Syncer(CONFIG, QuorumConfig(), initial_params=params_of(TinyNet(seed=100)))  # committed_rounds' syncer


def _held(run_dir) -> list[int]:
    return sorted(int(p.stem.removeprefix("round_")) for p in (run_dir / "rounds").glob("round_*.safetensors"))


def _same_state(a: Syncer, b: Syncer) -> bool:
    pa, pb = a.global_params(), b.global_params()
    return a.rounds_committed == b.rounds_committed and all(torch.equal(pa[n], pb[n]) for n in pa)


def test_round_files_before_the_older_kept_state_are_removed_and_a_restart_still_replays_bit_for_bit(tmp_path):
    live = _run(tmp_path)
    # States kept: rounds 8 and 12 (two newest). Rounds 0-7 are held by both: their files go, their lines stay.
    assert _held(tmp_path) == list(range(8, ROUNDS))
    assert len(SyncerStore(tmp_path).log.lines()) == ROUNDS
    restored = _fresh()
    assert SyncerStore(tmp_path).restore(restored).state_rounds == ROUNDS
    assert _same_state(restored, live)


def test_a_damaged_newest_state_falls_back_to_the_older_one_whose_rounds_are_still_there(tmp_path):
    live = _run(tmp_path)
    flip_bit_in_tensor_data(tmp_path / "checkpoints" / "syncer" / f"state_{ROUNDS:09d}.safetensors")
    restored = _fresh()
    outcome = SyncerStore(tmp_path).restore(restored)
    assert (outcome.state_rounds, outcome.replayed) == (8, 4)
    assert _same_state(restored, live)


def test_with_both_states_damaged_the_refusal_says_the_early_rounds_were_removed_not_damaged(tmp_path):
    _run(tmp_path)
    for serial in (8, ROUNDS):
        flip_bit_in_tensor_data(tmp_path / "checkpoints" / "syncer" / f"state_{serial:09d}.safetensors")
    with pytest.raises(ValueError, match=r"round 0's tensors file round_000000\.safetensors was removed, as every "
                                         r"round before 8 was.*--round-files all"):
        SyncerStore(tmp_path).restore(_fresh())


def test_keep_round_files_keeps_every_round_for_a_replay_from_the_genesis(tmp_path):
    live = _run(tmp_path, keep_round_files=True)
    assert _held(tmp_path) == list(range(ROUNDS))
    records = list(SyncerStore(tmp_path).log.records())
    from_genesis = _fresh()
    replay_onto(from_genesis, records)
    assert _same_state(from_genesis, live)


def test_a_new_process_removes_what_an_earlier_one_kept(tmp_path):
    """A syncer restarted with --round-files recent after running with all (or after a crash between a state and
    its pruning) removes the files its kept states hold at its first full state."""
    _run(tmp_path, keep_round_files=True)
    restored = _fresh()
    store = SyncerStore(tmp_path)
    store.restore(restored)
    store.save(restored, {})  # the full state a restarted syncer writes at start (same serial: replaces it)
    assert _held(tmp_path) == list(range(8, ROUNDS))


def test_with_one_full_state_nothing_is_removed(tmp_path):
    """Were the only state damaged, a restart would replay every round from the genesis."""
    _, records = _rounds()
    store = SyncerStore(tmp_path)
    for record in records:
        store.commit(record)
    at_end = _fresh()
    replay_onto(at_end, records)
    store.save(at_end, {})
    assert _held(tmp_path) == list(range(ROUNDS))
