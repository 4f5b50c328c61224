"""The README's library quickstart, run exactly as it is printed there."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _quickstart_source() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("### In one process", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README quickstart has no python block"
    return match.group(1)


def test_readme_quickstart_runs_and_trains(capsys):
    torch.set_num_threads(1)
    namespace: dict = {}
    exec(compile(_quickstart_source(), str(README), "exec"), namespace)  # noqa: S102
    syncer, learners = namespace["syncer"], namespace["learners"]
    # 64 inner steps per learner, P = 4 and H = 32: one round is due every 8 steps per learner.
    assert syncer.rounds_committed >= 8
    assert all(sync.inner_step == 64 and sync.final_state == "done" for sync in learners)
    assert "rounds committed" in capsys.readouterr().out
    torch.manual_seed(0)
    from ddiloco.model import build_model
    initial = dict(build_model().named_parameters())
    moved = [not torch.equal(initial[name].detach(), tensor) for name, tensor in syncer.global_params().items()]
    assert all(moved)
    trained = dict(namespace["trained"].named_parameters())  # hub.load_global: the global model, in place
    assert all(torch.equal(trained[name].detach(), tensor) for name, tensor in syncer.global_params().items())
