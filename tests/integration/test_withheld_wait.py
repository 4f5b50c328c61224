"""A learner alone in its run whose update is withheld (a non-finite pseudo-gradient, found on the publisher's thread
after the learner began to wait for that update's round) takes the withholding at once and trains on.

Before: nothing woke it, and it waited out `--max-wait-s` (60 s by default) at each such update (probe: 143.5 s for
a run of about 20 s). Real processes under `ddiloco run`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
MAX_WAIT_S = 30
SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn

import ddiloco

env = ddiloco.environment()
torch.manual_seed(env.seed)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
model.big = nn.Parameter(torch.zeros(4_000_000))  # its pseudo-gradient takes a moment on the publisher's thread
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(100 + env.learner_id)
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        x = torch.randn(64, 16, generator=generator)
        loss = F.mse_loss(model(x), x[:, :4].sin()) + model.big.sum() * 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if sync.inner_step == 20:
            with torch.no_grad():
                model[0].weight.fill_(float("nan"))  # the update of inner step 24 is withheld
        sync.step(tokens=64, loss=loss)
'''


@pytest.mark.acceptance  # the default suite's 15 minutes
def test_a_withheld_update_does_not_hold_its_learner_for_max_wait(tmp_path):
    script = tmp_path / "nan_once.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress",
                           "--json", "--learners", "1", "--inner-steps", "40", "--num-fragments", "1",
                           "--sync-every", "8", "--overlap-steps", "0", "--max-wait-s", str(MAX_WAIT_S),
                           "--threads", "1", "--no-evaluate", "--", sys.executable, str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["outcome"] == "completed"
    status = json.loads((run_dir / "learners" / "0" / "status.json").read_text())
    assert status["non_finite_recoveries"] >= 1, status  # the withheld update: the learner went back
    waits = [value for line in (run_dir / "learners" / "0" / "metrics.jsonl").read_text().splitlines()
             for key, value in json.loads(line).items() if key.endswith("wait_s")]
    assert max(waits, default=0.0) < MAX_WAIT_S / 3, waits
