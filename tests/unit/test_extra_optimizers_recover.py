"""A second optimizer the session knows of only through `state=` (a GAN's discriminator's) forgets its state that is
not finite when the learner recovers from a NaN step, as the session's own optimizer does (`Learner.recover`). Before,
only the session's optimizer did: the other's NaN moments made every later step NaN again, and the learner recovered at
every publish and contributed nothing."""

from __future__ import annotations

import logging

import torch
from torch import nn

import ddiloco
from tests.helpers import TinyNet, make_batches

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")
NAN_AT_STEP = 10


def gan_like() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"g": TinyNet(seed=1), "d": nn.Linear(16, 1)})


def loss_of(model: nn.ModuleDict, batch: torch.Tensor) -> torch.Tensor:
    logits = model["g"](batch[:, :-1])  # (B, T, V)
    lm = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return lm + model["d"](logits).square().mean()


def test_an_optimizer_in_state_forgets_its_non_finite_state_when_the_learner_recovers(caplog):
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    models = [gan_like(), gan_like()]
    opts_g = [torch.optim.AdamW(m["g"].parameters(), lr=1e-2) for m in models]
    opts_d = [torch.optim.AdamW(m["d"].parameters(), lr=1e-2) for m in models]
    sessions = [ddiloco.session(m, opt_g, hub=hub, learner_id=i, inner_steps=60, state={"opt_d": opt_d})
                for i, (m, opt_g, opt_d) in enumerate(zip(models, opts_g, opts_d, strict=True))]
    for sync in sessions:
        sync.start()
    batches = make_batches(8, seed=0)
    turn = 0
    with caplog.at_level(logging.ERROR):
        while not all(sync.done for sync in sessions):
            for i, (sync, m, opt_g, opt_d) in enumerate(zip(sessions, models, opts_g, opts_d, strict=True)):
                if sync.done or not sync.ready:
                    continue
                turn += 1
                loss = loss_of(m, batches[turn % len(batches)])
                if i == 0 and sync.inner_step == NAN_AT_STEP:
                    loss = loss * float("nan")  # both optimizers' moments go NaN
                opt_g.zero_grad()
                opt_d.zero_grad()
                loss.backward()
                opt_g.step()
                opt_d.step()
                sync.step(tokens=24)
        for sync in sessions:
            sync.close()
    assert sessions[0].learner.stats.non_finite_recoveries == 1
    assert "the inner optimizer forgets the state of 8 parameters" in caplog.text  # G's 6 and D's 2
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())
    assert all(bool(torch.isfinite(v).all()) for s in opts_d[0].state.values() for v in s.values())
    merged_at = [p.inner_step for r in hub.round_log for p in r.participants if p.learner_id == 0]
    assert len([s for s in merged_at if s > NAN_AT_STEP + 4]) >= 20


def test_optimizers_are_found_at_the_top_of_state_and_nested_in_dicts_and_lists():
    from ddiloco.non_finite import optimizers_in

    a, b, c = (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for _ in range(3))
    state = {"a": a, "nested": {"b": b, "more": [c, a]}, "seed": torch.Generator()}
    assert optimizers_in(state) == [a, b, c]
    assert optimizers_in(state, leaving_out=a) == [b, c]
    assert optimizers_in(None) == []
