"""A torch DataLoader with worker processes, started inside a session each epoch: real processes, real gRPC.

With gRPC's fork support on, every fork of a learner whose gRPC threads were running printed "Other threads are
currently calling into gRPC, skipping fork() handlers" into its log (9 lines in a 40-step run). `import ddiloco`
now turns that support off unless the environment says otherwise; training with the workers is unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.ray_cluster import descendants
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import SMALL_RUN, ddiloco_run, finish_run, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_TIMEOUT_S = 120

SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ddiloco

env = ddiloco.environment()
torch.manual_seed(env.seed)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
x_all = torch.randn(256, 8, generator=torch.Generator().manual_seed(env.learner_id))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
epochs = 0
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        loader = DataLoader(TensorDataset(x_all, x_all[:, :2].sin()), batch_size=32, shuffle=True, num_workers=2)
        for x, y in loader:  # the workers are forked here, with the session's gRPC threads running
            if sync.done:
                break
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=len(x), loss=loss.item())
        epochs += 1
print(f"epochs {epochs}", flush=True)
'''


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_dataloader_workers_forked_in_a_session_train_without_grpc_fork_noise(tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    status, output = ddiloco_run(run_dir, *SMALL_RUN, "--inner-steps", "40",
                                 command=(sys.executable, str(script)), timeout_s=RUN_TIMEOUT_S)
    assert status == 0, output
    for learner in (0, 1):
        log = (run_dir / "logs" / f"learner-{learner}.log").read_text()
        assert "epochs " in log, log[-2000:]                 # the workers ran, epoch after epoch
        assert "skipping fork() handlers" not in log, log[-2000:]


ENDLESS = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ddiloco

torch.set_num_threads(1)
env = ddiloco.environment()
torch.manual_seed(env.seed)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
x_all = torch.randn(256, 8, generator=torch.Generator().manual_seed(env.learner_id))
loader = DataLoader(TensorDataset(x_all, x_all[:, :2].sin()), batch_size=32, shuffle=True, num_workers=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
with ddiloco.session(model, optimizer) as sync:
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch, the workers live on
    while not sync.done:
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=len(x), loss=loss.item())
'''


@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_run_stopped_while_its_learners_dataloader_workers_run_stops_each_learner_cleanly(tmp_path):
    # The launcher's stop sent SIGTERM to each learner's whole process group: the DataLoader's workers died of it
    # before the script reached its next step(), torch raised "DataLoader worker (pid N) is killed by signal:
    # Terminated" in the learner (in its session's close), and the learner failed without its stop checkpoint.
    run_dir = tmp_path / "run"
    popen = _start_endless_run(tmp_path, run_dir)
    try:
        _wait_until_both_train(run_dir, popen)
    finally:
        output = finish_run(popen, timeout_s=RUN_TIMEOUT_S, interrupt=True)
    assert popen.returncode == 128 + signal.SIGINT, output
    for learner in (0, 1):
        status, log = _status(run_dir, learner), (run_dir / "logs" / f"learner-{learner}.log").read_text()
        assert status["state"] == "stopped" and status["stop_requested"], (status, log[-2000:])
        assert "is killed by signal" not in log, log[-2000:]
        assert status["checkpoint_inner_step"] == status["inner_step"], status  # its stop checkpoint was written


def _status(run_dir, learner: int) -> dict:
    return read_json_object(RunPaths(run_dir).learner_status(learner)) or {}


def _start_endless_run(tmp_path, run_dir) -> subprocess.Popen:
    """`ddiloco run` of the ENDLESS script, its own process group, its output piped."""
    script = tmp_path / "endless.py"
    script.write_text(ENDLESS)
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *SMALL_RUN,
                             "--inner-steps", "1000000", "--no-evaluate", "--", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_until_both_train(run_dir, popen) -> None:
    wait_until(lambda: all(_status(run_dir, i).get("inner_step", 0) > 20 for i in (0, 1)), "both learners to train",
               alive=(popen,))


@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_sigterm_to_every_process_of_the_job_stops_each_learner_with_its_checkpoint(tmp_path):
    # scancel, and systemd's stop of a service (KillMode=control-group), send SIGTERM to every process of the job
    # at once: the DataLoader's workers died of theirs, torch's SIGCHLD handler raised "DataLoader worker (pid N)
    # is killed by signal: Terminated" in the learner wherever it was (in its session's close, waiting for the
    # checkpoint at the stop), and the learner lost its steps since its last periodic checkpoint.
    run_dir = tmp_path / "run"
    popen = _start_endless_run(tmp_path, run_dir)
    try:
        _wait_until_both_train(run_dir, popen)
        # Each epoch forks its workers anew: the SIGTERMs go out while both learners' workers run.
        wait_until(lambda: len(set(descendants(popen.pid)) - _learner_and_syncer_pids(run_dir)) >= 4,
                   "two DataLoader workers of each learner", alive=(popen,))
        for pid in [popen.pid, *descendants(popen.pid)]:  # the whole job at once, as scancel does
            os.kill(pid, signal.SIGTERM)
        output, _ = popen.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    for learner in (0, 1):
        status, log = _status(run_dir, learner), (run_dir / "logs" / f"learner-{learner}.log").read_text()
        assert "learner_session.py" not in log, log[-3000:]  # nothing raised in the session's close
        assert status["checkpoint_inner_step"] == status["inner_step"], (status, log[-3000:])  # no step lost
        if status["state"] != "stopped":  # a worker killed before the learner's own SIGTERM: its next batch raises
            assert status["state"] == "failed" and "next(batches)" in log, (status, log[-3000:], output[-2000:])


def _learner_and_syncer_pids(run_dir) -> set[int]:
    return {_status(run_dir, i)["pid"] for i in (0, 1)} | {
        int(json.loads((run_dir / "syncer.json").read_text())["pid"])}
