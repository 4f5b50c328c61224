"""A learner whose run directory holds another run's checkpoint (a learner host's `--run-dir run` used again for a new
run, as docs/clusters.md's commands do): it resumed that run's inner step, optimizer and data position in the new run,
in silence (it trained 40 of 100 steps). The syncer's versions never go back, so a Welcome older than the checkpoint
names it; the learner stops as refused (exit status 3) and leaves the checkpoint as it was."""

from __future__ import annotations

import pytest
import torch

import ddiloco
from ddiloco.checkpoint import state_files
from ddiloco.exit_status import EXIT_REFUSED, ForeignCheckpointError
from tests.helpers import TinyNet, make_batches

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def train(run_dir, hub, inner_steps: int):
    model = TinyNet(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = make_batches(inner_steps, seed=0)
    with ddiloco.session(model, optimizer, hub=hub, learner_id=0, inner_steps=inner_steps, run_dir=run_dir) as sync:
        while not sync.done:
            batch = batches[sync.inner_step % len(batches)]
            logits = model(batch[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            sync.step(tokens=batch.numel())
    return sync


def new_hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def test_another_runs_checkpoint_is_refused_naming_it_and_kept(tmp_path):
    train(tmp_path, new_hub(), inner_steps=16)
    checkpoints = tmp_path / "learners" / "0" / "checkpoint"
    before = state_files(checkpoints)
    assert before and before[-1][0] == 16
    with pytest.raises(ForeignCheckpointError) as refused:
        train(tmp_path, new_hub(), inner_steps=40)  # a new run: its syncer is at version 0
    assert refused.value.code == EXIT_REFUSED
    assert str(refused.value).startswith(f"learner 0's checkpoint in {checkpoints} was taken at version 4 of fragment "
                                         "0 of the global model, and the syncer holds version 0")
    assert "Give this learner a new --run-dir" in str(refused.value)
    assert state_files(checkpoints) == before  # not written over by the refused session


def test_the_same_runs_checkpoint_still_resumes(tmp_path):
    hub = new_hub()
    train(tmp_path, hub, inner_steps=16)
    again = train(tmp_path, hub, inner_steps=24)  # the same run, later: resumed, not refused
    assert again.final_state == "done" and again.inner_step == 24
