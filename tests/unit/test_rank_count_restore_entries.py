"""What each rank of a learner takes from a checkpoint written by another number of ranks
(`LearnerGroup.restore_checkpoint`, `saved_optimizer_shards`), with a stand-in for the process group: the entries the
leader scatters are recorded instead. The real runs are tests/integration/test_rank_count_resume.py."""

from __future__ import annotations

from types import SimpleNamespace

from ddiloco.learner_group import LearnerGroup
from ddiloco.sharded_state import saved_optimizer_shards

HYPERPARAMETERS = {"param_groups": [{"lr": 0.5, "params": [0, 1]}]}
RANK0_SHARD = {"state": {0: {"exp_avg": "rank 0's half"}}, **HYPERPARAMETERS}
RANK1_SHARD = {"state": {0: {"exp_avg": "rank 1's half"}}, **HYPERPARAMETERS}
FSDP_RANKS = [None, {"state": {"data": 1}, "optimizer": RANK1_SHARD}]  # rank 0's entry is its own checkpoint
DDP_RANKS = [None, {"state": {"data": 1}, "optimizer": None}]


def entries_handed_out(ranks, saved_optimizer, *, size: int, sharded: bool, fits: bool) -> list[dict]:
    handed: list[list[dict]] = []
    group = SimpleNamespace(size=size, sharded=frozenset({"0.weight"}) if sharded else frozenset(),
                            optimizer_shards=size if sharded else 1, restore=handed.append)
    LearnerGroup.restore_checkpoint(group, ranks, saved_optimizer, learner_id=0, optimizer_fits=fits)
    (entries,) = handed
    return entries


def test_the_split_of_a_saved_optimizer_state_is_read_from_the_followers_entries():
    assert saved_optimizer_shards(None) == 1  # a learner of one process
    assert saved_optimizer_shards(DDP_RANKS) == 1  # replicas: rank 0's state is everyone's
    assert saved_optimizer_shards(FSDP_RANKS) == 2


def test_fsdp2_shards_of_two_ranks_resumed_on_three_give_every_rank_the_hyperparameters_only(caplog):
    hyperparameters_only = {**RANK0_SHARD, "state": {}}  # what LearnerCheckpoint loads on rank 0 as it does not fit
    entries = entries_handed_out(FSDP_RANKS, hyperparameters_only, size=3, sharded=True, fits=False)
    assert [entry["optimizer"] for entry in entries] == [hyperparameters_only] * 3
    assert [entry["state"] for entry in entries] == [{}] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "[learner 0] the checkpoint holds the state of 2 rank(s), this learner has 3: the other ranks start their "
        "state= objects afresh, and every rank its optimizer state (sharded over 2 ranks when saved; the "
        "hyperparameters as saved)"]


def test_fsdp2_shards_resumed_on_as_many_ranks_go_back_to_their_own_ranks(caplog):
    entries = entries_handed_out(FSDP_RANKS, RANK0_SHARD, size=2, sharded=True, fits=True)
    assert entries[1] == {"state": {"data": 1}, "optimizer": RANK1_SHARD}
    assert caplog.records == []


def test_ddp_replicas_resumed_on_another_number_of_ranks_all_take_rank_0s_optimizer_state(caplog):
    entries = entries_handed_out(DDP_RANKS, RANK0_SHARD, size=3, sharded=False, fits=True)
    assert [entry["optimizer"] for entry in entries] == [RANK0_SHARD] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "[learner 0] the checkpoint holds the state of 2 rank(s), this learner has 3: the other ranks start their "
        "state= objects (the optimizer is rank 0's) afresh"]
