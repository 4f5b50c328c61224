"""Learners of several ranks: `ddiloco run --nproc-per-learner 2 -- python examples/ddp.py` (real processes, real
gloo process groups, real gRPC, a real kill -9).

Each learner is a torchrun-style job of 2 ranks (DDP; or FSDP2 with --fsdp, one learner): rank 0 talks
to the syncer and the other rank follows it. A kill -9 of one rank of learner 0 takes down that learner's
group only; the supervisor restarts the group, which resumes from its checkpoint and contributes again,
while learner 1 never restarts. Afterwards the syncer's global state equals the replay of the round log
from the genesis, and the ranks of each learner end with the same model (each prints the loss of its own
copy; DDP replicas, FSDP shards).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import load_latest_state, read_json_object
from ddiloco.round_log import RoundLog
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import assert_global_state_is_the_replay

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
WAIT_S = 240.0
POLL_S = 0.1
FAST = ["--nproc-per-learner", "2", "--num-fragments", "2", "--sync-every", "8", "--threads", "1",
        "--checkpoint-every-s", "0.5", "--no-progress"]
FINAL = re.compile(r"learner (\d+) rank (\d+) final \{'val_loss': ([0-9.e-]+)\}")


def start_run(run_dir: Path, inner_steps: int, *script_args: str, learners: int = 2) -> subprocess.Popen:
    # --round-files all: the tests replay the whole round log from the genesis.
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *FAST,
                             "--learners", str(learners), "--round-files", "all",
                             "--inner-steps", str(inner_steps), "--", sys.executable, "examples/ddp.py", *script_args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for(condition, what: str, popen: subprocess.Popen):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        if popen.poll() is not None:
            pytest.fail(f"ddiloco run exited ({popen.returncode}) while waiting for {what}:\n{popen.communicate()[0]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(POLL_S)
    return value


def finish(popen: subprocess.Popen) -> str:
    try:
        out, _ = popen.communicate(timeout=WAIT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, out
    return out


def participations(run_dir: Path, learner_id: int) -> int:
    return sum(learner_id in [p["learner_id"] for p in line["participants"]] for line in RoundLog(run_dir).lines())


def assert_ranks_agree(run_dir: Path, learner_id: int) -> None:
    """The last start of the learner printed one final loss per rank, and they are equal."""
    log = RunPaths(run_dir).log(f"learner-{learner_id}").read_text()
    last_start = log.rsplit("=== ", 1)[-1]
    finals = {int(m[2]): float(m[3]) for m in FINAL.finditer(last_start) if int(m[1]) == learner_id}
    assert sorted(finals) == [0, 1], last_start[-2000:]
    assert finals[0] == finals[1]


def assert_completed(run_dir: Path, *, restarts: list[int]) -> None:
    summary = read_json_object(RunPaths(run_dir).summary)
    learners = [summary["learners"][str(i)] for i in range(len(restarts))]
    assert summary["outcome"] == "completed"
    assert [learner["state"] for learner in learners] == ["done"] * len(restarts)
    assert [learner["restarts"] for learner in learners] == restarts
    assert all(learner["tokens"] > 0 for learner in learners)


def kill_a_follower(run_dir: Path, popen: subprocess.Popen) -> tuple[int, int]:
    """Once learner 0 has checkpointed and merged, kill -9 its rank 1 (not the rank that talks to the syncer) and
    wait for the restarted group; returns (the inner step of the checkpoint it resumes from, rounds it had merged)."""
    paths = RunPaths(run_dir)
    ranks_file = paths.learner_dir(0) / "ranks.json"
    checkpoint_dir = paths.learner_dir(0) / "checkpoint"
    wait_for(lambda: (s := load_latest_state(checkpoint_dir)) is not None and s[2] > 0
             and participations(run_dir, 0) >= 2, "learner 0 checkpointed and merged", popen)
    group = read_json_object(ranks_file)
    os.kill(group["ranks"][1], signal.SIGKILL)
    _, _, checkpoint_step = load_latest_state(checkpoint_dir)
    merged_before = participations(run_dir, 0)
    wait_for(lambda: (g := read_json_object(ranks_file)) is not None and g["pid"] != group["pid"],
             "learner 0 restarted", popen)
    restarted = read_json_object(ranks_file)
    assert restarted["master_port"] and restarted["ranks"] != group["ranks"]
    return checkpoint_step, merged_before


def assert_resumed(run_dir: Path, checkpoint_step: int, merged_before: int, out: str) -> None:
    starts = [json.loads(line) for line in (RunPaths(run_dir).learner_dir(0) / "work.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert len(starts) == 2 and starts[1]["inner_step"] >= checkpoint_step > 0  # resumed, not from inner step 0
    assert participations(run_dir, 0) > merged_before + 2, out  # it contributed again after the restart


@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(600)
def test_a_kill9_of_one_ddp_rank_restarts_only_its_learner_which_contributes_again(tmp_path):
    run_dir = tmp_path / "run"
    popen = start_run(run_dir, 200)
    checkpoint_step, merged_before = kill_a_follower(run_dir, popen)
    out = finish(popen)
    assert_completed(run_dir, restarts=[1, 0])
    assert_resumed(run_dir, checkpoint_step, merged_before, out)
    assert_global_state_is_the_replay(run_dir)
    for learner_id in (0, 1):
        assert_ranks_agree(run_dir, learner_id)


@pytest.mark.acceptance  # beside test_rank_count_resume.py's FSDP2 resume; the DDP kill -9 stays in the default suite
@pytest.mark.timeout(600)
def test_an_fsdp2_learner_resumes_its_shards_after_a_kill9_and_the_global_state_is_the_replay(tmp_path):
    run_dir = tmp_path / "run"
    popen = start_run(run_dir, 96, "--fsdp", learners=1)
    checkpoint_step, merged_before = kill_a_follower(run_dir, popen)
    out = finish(popen)
    assert_completed(run_dir, restarts=[1])
    assert_resumed(run_dir, checkpoint_step, merged_before, out)  # each rank's optimizer shard restored
    assert_global_state_is_the_replay(run_dir)
    assert_ranks_agree(run_dir, 0)


def _resume_sharded_optimizer(rank: int, port: int) -> None:
    """Two identical FSDP2 models train alike; one's optimizer goes through a checkpoint (its local shards,
    pickled) into a fresh optimizer; one more step must leave both models bit-identical."""
    import pickle

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddiloco.sharded_state import local_tensors, reshard_optimizer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(fully_shard(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 4, generator=data) for _ in range(3)]

    def train(model, optimizer, batch):
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in batches[:2]:
        for model, optimizer in zip(models, optimizers, strict=True):
            train(model, optimizer, batch)
    saved = pickle.loads(pickle.dumps(local_tensors(optimizers[1].state_dict())))
    resumed = torch.optim.AdamW(models[1].parameters(), lr=1e-2)
    resumed.load_state_dict(saved)
    reshard_optimizer(resumed)
    train(models[0], optimizers[0], batches[2])
    train(models[1], resumed, batches[2])
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    dist.destroy_process_group()
    # Checked; leave without the interpreter's teardown. FSDP2's device mesh keeps the gloo process group alive past
    # destroy_process_group, and its threads torn down during finalization can abort the process: rank 1 once
    # ended here with SIGABRT ("terminate called without an active exception") after every assert had passed
    # (CI, 2026-12-04, under load), as FSDP2 ranks of examples/ddp.py were seen to at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.timeout(300)
def test_a_sharded_optimizer_state_survives_its_checkpoint_bit_for_bit():
    import torch.multiprocessing as mp

    from ddiloco.runtime.rank_group import free_port

    mp.spawn(_resume_sharded_optimizer, args=(free_port(),), nprocs=2, join=True)
