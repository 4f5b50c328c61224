"""How `ddiloco run` reads a learner's exit (`runtime.learner_exits`), with real processes: `ddiloco run` and a tiny
script that faults at a given inner step (once: a marker file), so each fault is scheduled by step, not by sleeping.

- A SIGTERM that `ddiloco run` did not send (a preemption, a `kill` instead of a `kill -9`) to a learner, or to one
  rank of a learner of several ranks: the session stops cleanly (checkpoint, Leave, exit 0, status `stopped`), and the
  launcher restarts it like any exit before the budget; it resumes from that checkpoint and the run completes with
  every learner at its budget. A script whose own loop ends before the budget is still done, not restarted.
- A rank of a learner of several ranks that raises: the console quotes its exception, not the rank group's line nor
  the error another rank met in a collective with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ddiloco_run

RUN_S = 240.0
"""Hard limit on one `ddiloco run` (about 20 s on an idle 2-core machine; minutes when it is shared)."""
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(RUN_S + 60)]  # after ddiloco_run's
INNER_STEPS = 30
AT_STEP = 10
FLAGS = ("--learners", "1", "--inner-steps", str(INNER_STEPS), "--num-fragments", "1", "--sync-every", "5",
         "--threads", "1", "--no-progress")

SCRIPT = '''
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import ddiloco

mode, at, faulty_rank, marker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
env = ddiloco.environment()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(4, 2)
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
rank, trained = 0, model
if distributed:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, trained = dist.get_rank(), DistributedDataParallel(model)
optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
generator = torch.Generator().manual_seed(10 * env.learner_id + rank)
with ddiloco.session(trained, optimizer) as sync:
    while not sync.done:
        if mode == "loop_ends" and sync.inner_step == at:
            break
        if mode != "loop_ends" and sync.inner_step == at and rank == faulty_rank and not marker.exists():
            marker.touch()
            if mode == "raise":
                raise RuntimeError(f"rank {rank} broke at inner step {at}")
            os.kill(os.getpid(), signal.SIGTERM)  # from outside the launcher, as a preemption would be
        x = torch.randn(8, 4, generator=generator)
        loss = nn.functional.mse_loss(trained(x), x[:, :2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=len(x), loss=loss.item())
if distributed:
    dist.destroy_process_group()
# Leave without the interpreter's teardown: gloo's threads torn down during finalization can abort a rank
# ("terminate called without an active exception", exit 134), which the launcher rightly reads as a crash.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''
"""`python SCRIPT MODE AT RANK MARKER`: at inner step AT (once), MODE `sigterm` SIGTERMs rank RANK of each learner,
`raise` raises there; `loop_ends` ends the loop of every rank there."""


def run_script(tmp_path: Path, mode: str, *flags: str, rank: int = 0) -> tuple[int, str, dict]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    code, output = ddiloco_run(run_dir, *FLAGS, *flags, timeout_s=RUN_S,
                               command=["python", str(script), mode, str(AT_STEP), str(rank), str(tmp_path / "marker")])
    return code, output, json.loads((run_dir / "summary.json").read_text())


# The two-rank case in acceptance: the default suite keeps under 15 minutes on 2 cores.
@pytest.mark.parametrize("flags, rank", [((), 0), pytest.param(("--nproc-per-learner", "2"), 1,
                                                                 marks=pytest.mark.acceptance)],
                         ids=["learner", "rank-1"])
def test_a_learner_stopped_by_a_sigterm_from_outside_is_restarted_and_reaches_its_budget(tmp_path, flags, rank):
    code, output, summary = run_script(tmp_path, "sigterm", *flags, rank=rank)
    assert (tmp_path / "marker").exists(), output
    learner = summary["learners"]["0"]
    assert code == 0 and summary["outcome"] == "completed", output
    assert learner["state"] == "done" and learner["inner_step"] == INNER_STEPS and learner["restarts"] == 1, output
    assert (f"[learner-0] exited (stopped at inner step {AT_STEP + 1} of {INNER_STEPS} by a signal ddiloco run did "
            "not send: restarted from its checkpoint)") in output


def test_a_script_whose_loop_ends_before_the_budget_is_done_and_not_restarted(tmp_path):
    code, output, summary = run_script(tmp_path, "loop_ends")
    learner = summary["learners"]["0"]
    assert code == 0 and learner["state"] == "done", output
    assert learner["inner_step"] == AT_STEP and learner["restarts"] == 0, output
    assert (f"[learner-0] exited (done: its loop ended at inner step {AT_STEP} of {INNER_STEPS}, before the budget; "
            "not restarted)") in output


@pytest.mark.acceptance  # the default suite's 15 minutes
def test_a_failed_rank_is_quoted_with_its_own_exception(tmp_path):
    code, output, summary = run_script(tmp_path, "raise", "--nproc-per-learner", "2", rank=0)
    assert code == 0 and summary["learners"]["0"]["restarts"] == 1, output
    assert f"[learner-0] exited with exit code 1: RuntimeError: rank 0 broke at inner step {AT_STEP}\n" in output
