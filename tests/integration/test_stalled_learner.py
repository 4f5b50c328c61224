"""A learner whose loop hangs while its process lives (its heartbeats go on) under `ddiloco run --min-quorum M`, real
processes and real gRPC: the syncer stops waiting for it after `--progress-timeout-s`, the other learner's rounds go
on, and once its loop runs again it counts in the quorum again and the run completes.

Before: every round waited for it for as long as it hung, and the global model stood still."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PROCESS_WAIT_S

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
SCRIPT = '''
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddiloco

env = ddiloco.environment()
torch.manual_seed(env.seed)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
generator = torch.Generator().manual_seed(100 + env.learner_id)
hung, release = Path(sys.argv[1]), Path(sys.argv[2])
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        if env.learner_id == 1 and sync.inner_step == 20 and not release.exists():
            hung.touch()
            while not release.exists():  # a loop that hangs (a dead NFS read, a deadlock); heartbeats go on
                time.sleep(0.05)
        x = torch.randn(32, 8, generator=generator)
        loss = F.mse_loss(model(x), x[:, :2].sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(loss=loss, tokens=32)
        time.sleep(0.01)  # paced, so that learner 0 is still training while the test looks at the rounds
'''


def wait_for(predicate, what: str, timeout_s: float = PROCESS_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def syncer_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "syncer_status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.acceptance  # about 40 s: the default suite's time; the core's rule is in tests/unit/test_stalled_member.py
def test_a_hung_learner_stops_holding_the_rounds_of_a_k_equal_m_run_and_counts_again_after(tmp_path):
    script, hung, release = tmp_path / "hangs.py", tmp_path / "hung", tmp_path / "release"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json",
         "--learners", "2", "--min-quorum", "2", "--progress-timeout-s", "2", "--inner-steps", "1000",
         "--num-fragments", "1", "--sync-every", "4", "--threads", "1", "--", sys.executable, str(script), str(hung),
         str(release)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(hung.exists, "learner 1's loop to hang")
        wait_for(lambda: syncer_status(run_dir).get("stalled_learners") == [1],
                 "the syncer to stop waiting for learner 1 (it heartbeats, its loop hangs)")
        committed = syncer_status(run_dir)["rounds_committed"]
        wait_for(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= committed + 3,
                 "learner 0's rounds to go on without learner 1")
        status = syncer_status(run_dir)
        assert status["effective_quorum"] == 1 and 1 in status["alive_learners"]  # alive, not waited for
        release.touch()
        out, _ = launcher.communicate(timeout=PROCESS_WAIT_S * 2)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed"
    assert all(learner["state"] == "done" for learner in summary["learners"].values()), summary["learners"]
    log = (run_dir / "logs" / "syncer.log").read_text()
    assert "learner 1 has sent no update in the" in log and "learner 1 sends updates again" in log
    # Once back it took part in rounds again: its updates after the hang were merged.
    assert summary["learners"]["1"]["updates_accepted"] > 20 // 4, summary["learners"]["1"]
