"""The ranks of one learner must meet where ddiloco needs them: every rank opens `ddiloco.session`, and every rank
calls `sync.step()` once after each `optimizer.step()`. Real `ddiloco run --nproc-per-learner 2` runs of a DDP script
(real processes, real gloo process groups, real gRPC) that breaks the rule once, on one rank of its first start.

A rank that called `sync.step()` once more than rank 0 waited in it for rank 0's command while rank 0 waited in DDP's
gradient all-reduce for that rank: the learner froze with nothing said (and a rank that never opened the session, a
`if rank == 0: with ddiloco.session(...)` script, froze it at inner step 0). Now the rank that waits in ddiloco raises
`RanksOutOfStepError` after a bounded wait, naming the cause in one line of the learner's log; the learner's group
fails, and its restart (which does not repeat the fault) trains to the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import finish_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
WAIT_S = 300.0
"""Each run takes about 30 s on 2 idle cores (minutes when they are shared); the runs that froze never ended."""
RANK_WAIT_S = 4.0
"""The script's bound on a rank's wait for the others (`ddiloco.learner_group.RANK_WAIT_S`), short for the test."""
FAST = ["--learners", "1", "--nproc-per-learner", "2", "--num-fragments", "2", "--sync-every", "8", "--threads", "1",
        "--checkpoint-every-s", "0.5", "--inner-steps", "24", "--no-progress"]

SCRIPT = '''
import os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import ddiloco, ddiloco.learner_group

fault, at, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ddiloco.learner_group.RANK_WAIT_S = float(sys.argv[4])
env = ddiloco.environment()
torch.set_num_threads(1)
torch.manual_seed(env.seed)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(env.seed * 100 + rank)

def train():
    x = torch.randn(16, 8, generator=data)
    loss = F.mse_loss(model(x), x[:, :2].tanh())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return len(x)

faulty = rank == 1 and not os.path.exists(marker)  # once: the restarted learner keeps the rule
if faulty:
    open(marker, "w").close()
if faulty and fault == "no-session":  # the mistake `if rank == 0: with ddiloco.session(...)`
    while True:
        train()
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        if faulty and fault == "extra" and sync.inner_step == at:
            sync.step(tokens=0)  # one sync.step() too many
        if faulty and fault == "leave" and sync.inner_step == at:
            break  # this rank's data ran out: it leaves the loop alone
        sync.step(tokens=train())
print(f"rank {rank} done at inner step {sync.inner_step}", flush=True)
dist.destroy_process_group()
'''


def run_with_fault(tmp_path: Path, fault: str) -> tuple[RunPaths, str]:
    script = tmp_path / "out_of_step.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *FAST, "--",
                              sys.executable, str(script), fault, "10", str(tmp_path / "faulted"), str(RANK_WAIT_S)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = finish_run(popen, timeout_s=WAIT_S)
    paths = RunPaths(run_dir)
    log = paths.log("learner-0").read_text() if paths.log("learner-0").exists() else ""
    assert popen.returncode == 0, f"{out}\n--- learner-0.log:\n{log[-4000:]}"
    return paths, log


def assert_restarted_once_and_done(paths: RunPaths, log: str) -> None:
    learner = read_json_object(paths.summary)["learners"]["0"]
    assert (learner["state"], learner["restarts"]) == ("done", 1), log[-4000:]
    assert "rank 0 done at inner step 24" in log.rsplit("=== ", 1)[-1]


def error_lines(log: str) -> list[str]:
    return [line.split("RanksOutOfStepError: ", 1)[1] for line in log.splitlines() if "RanksOutOfStepError: " in line]


WHOLE_RUN_ERRORS = {
    "extra": "rank 1 of this learner called sync.step() at inner step 10 without an optimizer.step() since its last "
             f"sync.step(), and rank 0 has not called sync.step() within {RANK_WAIT_S:g} s: this is a sync.step() too "
             "many (rank 0 waits meanwhile in its own training step's collectives, DDP's or FSDP's, for this rank). "
             "Every rank must call sync.step() exactly once after each optimizer.step()",
    "no-session": f"rank(s) 1 of this learner did not open ddiloco.session(...) within {RANK_WAIT_S:g} s of rank 0: "
                  "every rank of a learner must open it (`with ddiloco.session(model, optimizer) as sync:` on every "
                  "rank, not only on rank 0), and every rank call sync.step() once after each optimizer.step()",
    "leave": "rank 1 of this learner left its training loop at inner step 10 (its session closed), and rank 0 did not "
             f"leave its own within {RANK_WAIT_S:g} s: every rank must leave the loop at the same step. Loop `while "
             "not sync.done` on every rank (it turns true on all of them at once); a rank whose data ends first must "
             "tell the others (an all_reduce of a flag each step), not break alone",
}
"""Per fault of the script: the one error line its learner's log holds."""


@pytest.mark.acceptance  # a whole run of two-rank learners: make acceptance (the bare-group tests below are quick)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", list(WHOLE_RUN_ERRORS))
def test_a_rank_that_breaks_a_rule_fails_its_learner_naming_it_and_the_restart_trains_to_the_end(tmp_path, fault):
    paths, log = run_with_fault(tmp_path, fault)
    assert error_lines(log) == [WHOLE_RUN_ERRORS[fault]], log[-4000:]
    assert_restarted_once_and_done(paths, log)


# ---- the same rules on a bare LearnerGroup of two gloo ranks (rank 0 driving as a Session does, rank 1 serving) ----

def _ranks(rank: int, port: int, fault: str, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddiloco.learner_group import LearnerGroup, RanksOutOfStepError

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    # "extra": a training without collectives
    trained = DistributedDataParallel(model) if fault in ("skip", "leave 0", "leave 1") else model
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    group = LearnerGroup(model, rank_wait_s=RANK_WAIT_S)
    group.meet(optimizer)
    outcome = {"steps": 0}

    def train() -> None:
        trained(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        for inner_step in range(6):
            faulty = rank == 1 and inner_step == 3
            if fault == f"leave {rank}" and inner_step == 3:
                group.meet_at_close(inner_step)  # this rank leaves its loop alone (a break, its data ran out)
            if faulty and fault == "extra":
                group.serve(stepping=True)  # a sync.step() too many, right after the last one
            train()
            if faulty and fault == "skip":
                continue  # no sync.step() after this optimizer.step()
            if rank == 0:
                group.step(tokens=3)
                group.end(inner_step + 1, done=False)
            else:
                group.serve(tokens=3, stepping=True)
            outcome["steps"] += 1
        group.meet_at_close(6)  # both ranks leave the loop at the same step: the close goes on at once
        outcome["result"] = "ok"
    except RanksOutOfStepError as exc:
        outcome["result"] = str(exc)
    except RuntimeError as exc:  # the collective it waited in broke, as the other rank's process ended
        outcome["result"] = f"{type(exc).__name__}: {exc}"
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))
    sys.stdout.flush()
    os._exit(0)  # not destroy_process_group: the other rank may still wait in a collective of the broken group


def _run_ranks(tmp_path: Path, fault: str) -> list[dict]:
    import json

    import torch.multiprocessing as mp

    from ddiloco.runtime.rank_group import free_port

    mp.spawn(_ranks, args=(free_port(), fault, str(tmp_path)), nprocs=2, join=True)
    return [json.loads(path.read_text()) if (path := tmp_path / f"{rank}.json").exists() else {} for rank in range(2)]


@pytest.mark.timeout(120)
def test_ranks_whose_optimizer_steps_between_two_sync_steps_differ_raise_at_once_on_every_rank(tmp_path):
    leader, follower = _run_ranks(tmp_path, "extra")
    assert leader["steps"] == follower["steps"] == 3  # the call too many met rank 0's fourth: caught there
    assert follower["result"] == (
        "rank 1 of this learner called sync.step() at inner step 3 after 0 optimizer.step() call(s) since its last "
        "sync.step(), rank 0 after 1: the ranks are out of step. Every rank must call sync.step() exactly once after "
        "each optimizer.step()")
    assert leader["result"] == (
        "1 rank(s) of this learner called sync.step() at inner step 3 after another number of optimizer.step() calls "
        "since their last sync.step() than rank 0 (1): the ranks are out of step. Every rank must call sync.step() "
        "exactly once after each optimizer.step()")


@pytest.mark.timeout(120)
def test_a_rank_that_skips_a_sync_step_leaves_rank_0_waiting_a_bounded_time_naming_the_rule(tmp_path):
    leader, _ = _run_ranks(tmp_path, "skip")  # rank 1 waits in DDP's all-reduce; its process ends with rank 0's
    assert leader["steps"] == 3
    assert leader["result"] == (
        f"rank 0 of this learner waited {RANK_WAIT_S:g} s in sync.step() at inner step 3 for the other ranks to call "
        "it: a rank that skipped a sync.step() waits meanwhile in its next training step's collectives (DDP's or "
        "FSDP's) for this one. Every rank must call sync.step() exactly once after each optimizer.step()")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("leaving", [0, 1])
def test_a_rank_that_leaves_its_loop_alone_fails_its_learner_within_the_bound_naming_the_rule(tmp_path, leaving):
    # It waited in its session's close for the other ranks, and they waited for it in DDP's all-reduce: the learner
    # froze with nothing said (rank 1 leaving: for gloo's 30 minutes; rank 0 too, in its first command of the close).
    outcomes = _run_ranks(tmp_path, f"leave {leaving}")
    assert outcomes[leaving]["steps"] == 3
    others = "rank 0 did not leave its own" if leaving else "rank(s) 1 did not leave theirs"
    assert outcomes[leaving]["result"] == (
        f"rank {leaving} of this learner left its training loop at inner step 3 (its session closed), and {others} "
        f"within {RANK_WAIT_S:g} s: every rank must leave the loop at the same step. Loop `while not sync.done` on "
        "every rank (it turns true on all of them at once); a rank whose data ends first must tell the others (an "
        "all_reduce of a flag each step), not break alone")
    assert outcomes[1 - leaving]["result"].startswith("RuntimeError: "), outcomes  # its all-reduce broke with it


@pytest.mark.timeout(120)
def test_ranks_that_leave_their_loop_together_close_at_once(tmp_path):
    assert [outcome["result"] for outcome in _run_ranks(tmp_path, "none")] == ["ok", "ok"]
