"""The periodic checkpoint holds what the loop did after `sync.step()` in the same iteration (a scheduler stepped
there): a learner killed (-9) and restarted from it resumed its scheduler one step behind its inner step, once per
crash, and a schedule shorter than the run then failed one step later at each restart, so the rule that gives up a
learner failing at the same inner step 3 times never held. Real processes: the script runs with an in-process hub
and kills itself with SIGKILL; the test reads the checkpoint it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ddiloco.checkpoint import load_latest_state

REPO = Path(__file__).resolve().parents[2]
SCRIPT = '''
import itertools, os, signal, sys, torch
from pathlib import Path
from torch import nn
import ddiloco
from ddiloco.checkpoint import state_files
from tests.helpers import TinyNet, make_batches, train_step

hub = ddiloco.InProcessHub(config=ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32"),
                           quorum=ddiloco.QuorumConfig(grace="none"))
model = TinyNet(seed=1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
batches = itertools.cycle(make_batches(40, seed=0))
checkpoints = Path(sys.argv[1]) / "learners" / "0" / "checkpoint"
with ddiloco.session(model, optimizer, hub=hub, learner_id=0, inner_steps=10**6, run_dir=sys.argv[1],
                     state={"schedule": schedule}, checkpoint_every_s=1e-9) as sync:
    while not sync.done:
        sync.step(tokens=train_step(model, optimizer, next(batches)))
        schedule.step()  # after sync.step(), as many loops have it
        # A checkpoint due while the one before is written waits for it: train on until one of step 20 or later is
        # on disk, however loaded the machine.
        if sync.inner_step >= 25 and (state_files(checkpoints) or [(0,)])[-1][0] >= 20:
            os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_checkpoint_taken_in_the_loop_holds_the_scheduler_stepped_after_sync_step(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=REPO, capture_output=True,
                          text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    state, meta, serial = load_latest_state(tmp_path / "run" / "learners" / "0" / "checkpoint")
    assert serial >= 20, serial  # a checkpoint of the loop's, not of its close
    assert state["state"]["schedule"]["last_epoch"] == serial, (state["state"]["schedule"], serial)
