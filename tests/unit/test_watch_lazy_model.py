"""`ddiloco.watch` on a model whose shapes are not known yet (a lazy module before its first forward pass) or that has
no values (on the meta device) is refused at once, with the message `ddiloco.session` gives, naming `ddiloco.watch`:
not a torch-internal `ValueError` from deep inside the evaluator, at every restart."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.config import LearnerConfig
from ddiloco.run_config import RunConfig

NOWHERE = "127.0.0.1:1"
"""A syncer address nothing answers at: the refusal comes before any connection."""
GIVE_UP = RunConfig(learner=LearnerConfig(connect_timeout_s=0.5))
"""Without the refusal, a watch that gives up on that address soon (`UnreachableError`), not after 120 s."""


def evaluate(model):
    return 0.0


def test_watching_a_lazy_model_not_yet_run_is_refused_with_what_to_do():
    model = nn.Sequential(nn.LazyLinear(8), nn.GELU(), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not initialized yet \(a lazy module; 4 in all\): "
                                         r"run one forward pass before ddiloco.watch\(...\)"):
        ddiloco.watch(model, evaluate, syncer=NOWHERE, config=GIVE_UP)


def test_watching_a_model_on_the_meta_device_is_refused_with_what_to_do():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device.*before ddiloco.watch\(...\)"):
        ddiloco.watch(model, evaluate, syncer=NOWHERE, config=GIVE_UP)
