"""The ranks of one learner compare their replicas at each fragment's first publish (`LearnerGroup.check_replicas`):
two real gloo processes, rank 0 driving (`read`, `write`, `end`) and rank 1 serving, as in a learner of two ranks.

Replicas trained apart (a script without DDP under `--nproc-per-learner 2`) made every sync overwrite rank 1's
training with rank 0's while its tokens still counted, silently; now both ranks raise, naming the cause.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

FRAGMENTS = (("0.weight", "0.bias"), ("1.weight", "1.bias"))


def _ranks(rank: int, port: int, apart: bool, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddiloco.learner_group import LearnerGroup
    from ddiloco.replica_check import ReplicasDivergedError

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)  # each rank's own initialisation: the SET makes the replicas equal
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 2))
    group = LearnerGroup(model)
    group.fragments = FRAGMENTS
    params = dict(model.named_parameters())
    outcome = {"checks": 0}

    def train() -> None:  # one inner step: alike on every rank (DDP), or rank 1's own (apart)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * (rank + 1 if apart else 1))

    try:
        if rank == 0:
            group.read(1, FRAGMENTS[1])  # never sent to the ranks yet (a genesis gather): nothing to compare
            group.write(0, {n: torch.full_like(params[n], 0.5) for n in FRAGMENTS[0]})
            group.end(0, done=False)
            train()
            values = group.read(0, FRAGMENTS[0])  # the first publish since the SET: compared
            outcome["value"] = float(values["0.bias"][0])
            group.read(0, FRAGMENTS[0])  # once per fragment
            group.end(1, done=True)
        else:
            group.serve()
            train()
            group.serve()
        outcome["result"] = "ok"
    except ReplicasDivergedError as exc:
        outcome["result"] = str(exc)
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _run(tmp_path: Path, *, apart: bool) -> list[dict]:
    import torch.multiprocessing as mp

    from ddiloco.runtime.rank_group import free_port

    mp.spawn(_ranks, args=(free_port(), apart, str(tmp_path)), nprocs=2, join=True)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.timeout(120)
def test_replicas_kept_equal_pass_the_check_and_publish_rank_0s_value(tmp_path):
    leader, follower = _run(tmp_path, apart=False)
    assert leader["result"] == follower["result"] == "ok"
    assert leader["value"] == pytest.approx(0.501)


@pytest.mark.timeout(120)
def test_replicas_trained_apart_stop_both_ranks_naming_the_cause(tmp_path):
    leader, follower = _run(tmp_path, apart=True)
    assert leader["result"] == follower["result"]
    message = leader["result"]
    assert message.startswith("the 2 ranks of this learner hold different values of parameter '0.weight' (fragment 0:")
    assert "they trained apart, and ddiloco publishes rank 0's copy only" in message
    assert "Wrap the model in DistributedDataParallel (or shard it with FSDP2's fully_shard)" in message
    assert "or run one process per learner" in message
