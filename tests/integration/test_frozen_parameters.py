"""A model with frozen layers under `ddiloco run`, real processes and real gRPC: the frozen parameters' zero
pseudo-gradients and zero changes travel as their headers alone (`ddiloco.zero_encodings`), and their values come out
of the run exactly as they went in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.compression import get_codec

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
TIMEOUT_S = 240
SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn

import ddiloco

env = ddiloco.environment()
torch.manual_seed(env.seed)
model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256),
                      nn.Linear(256, 4))
model[0].requires_grad_(False)  # a fine-tuning set-up: the first two layers stay as they are
model[2].requires_grad_(False)
generator = torch.Generator().manual_seed(100 + env.learner_id)
teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        x = torch.randn(64, 16, generator=generator)
        loss = F.mse_loss(model(x), torch.tanh(x @ teacher))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(loss=loss, tokens=64)
'''
FROZEN = {"0.weight": 256 * 16, "0.bias": 256, "2.weight": 256 * 256, "2.bias": 256}
TRAINED = {"4.weight": 256, "4.bias": 256, "5.weight": 4 * 256, "5.bias": 4}


def encoded(codec: str, numels: dict[str, int]) -> int:
    return sum(get_codec(codec).encoded_nbytes(n) for n in numels.values())


@pytest.mark.acceptance  # 13 s: the default suite's time
def test_frozen_layers_cost_no_bytes_and_keep_their_values(tmp_path):
    script = tmp_path / "frozen.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress",
                           "--json", "--learners", "2", "--inner-steps", "48", "--num-fragments", "1",
                           "--sync-every", "8", "--threads", "1", "--", sys.executable, str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["rounds_committed"] >= 3

    # Uplink: the syncer counts what travelled. Every update holds the one fragment: the trained tensors' int4 bytes.
    updates = sum(summary["learners"][i]["updates_sent"] for i in ("0", "1"))
    assert 0 < summary["syncer"]["bytes_received"] <= updates * encoded("int4", TRAINED)
    for learner in summary["learners"].values():
        genesis = 4 * sum({**FROZEN, **TRAINED}.values())  # the learner that proposed the initial model sent it
        sent = learner["bytes_sent"] - (genesis if learner["bytes_sent"] > genesis else 0)
        # Before: each update also carried the frozen tensors' int4 encoding (about 36 KB here) .
        assert sent < learner["updates_sent"] * encoded("int4", FROZEN) / 10, learner
        # Downlink: the Welcome's float32 model, then changes of the trained tensors only (int8).
        received_changes = learner["bytes_received"] - genesis
        assert received_changes < summary["rounds_committed"] * encoded("int8", FROZEN) / 10, learner

    out = tmp_path / "export.safetensors"
    subprocess.run([sys.executable, "-m", "ddiloco.cli", "export", str(run_dir), "--out", str(out)], check=True,
                   cwd=REPO, capture_output=True, timeout=TIMEOUT_S)
    exported, genesis_tensors = load_file(out), load_file(run_dir / "genesis.safetensors")
    assert all(torch.equal(exported[name], genesis_tensors[name]) for name in FROZEN)  # bit for bit
    assert all(not torch.equal(exported[name], genesis_tensors[name]) for name in ("5.weight", "4.weight"))
