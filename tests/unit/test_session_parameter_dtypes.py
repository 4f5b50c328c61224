"""`ddiloco.session` and the dtypes of a model's parameters: the run keeps them in float32.

A parameter float32 cannot hold (complex, an integer) is refused at `ddiloco.session(...)`, naming it; a float64
one trains, with a warning that it is synchronised in float32; bf16 and fp16 (mixed precision) train as before.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.clock import VirtualClock
from ddiloco.inprocess import InProcessHub
from ddiloco.learner import Learner
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


def hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def test_a_complex_parameter_is_refused_naming_it_and_what_to_do():
    # It was cast to float32 at every sync, its imaginary part dropped with only torch's UserWarning.
    model = TinyNet(seed=1)
    model.spectrum = nn.Parameter(torch.randn(8, 2, dtype=torch.cfloat))
    with pytest.raises(TypeError, match=r"parameter 'spectrum' is complex64 \(1 parameter of a dtype float32 cannot "
                                        r"hold\): .* in float32, which would drop the imaginary part .*"
                                        r"torch.view_as_real"):
        ddiloco.session(model, torch.optim.AdamW(model.parameters()), hub=hub(), learner_id=0)


def test_an_integer_parameter_is_refused_naming_it_and_saying_to_make_it_a_buffer():
    # A frozen int64 parameter 16777217 came back 16777216: float32 holds integers exactly up to 2^24 only.
    model = TinyNet(seed=1)
    model.index = nn.Parameter(torch.tensor([16777217, 3]), requires_grad=False)
    model.mask = nn.Parameter(torch.ones(3, dtype=torch.bool), requires_grad=False)
    with pytest.raises(TypeError, match=r"parameter 'index' is int64 \(2 parameters of a dtype float32 cannot hold: "
                                        r"'index', 'mask'\): .*register_buffer\(.index., tensor\)"):
        ddiloco.session(model, torch.optim.SGD(TinyNet(seed=1).parameters(), lr=0.1), hub=hub(), learner_id=0)


def test_a_float64_parameter_trains_in_float32_with_one_warning_naming_it(caplog):
    model = TinyNet(seed=1)
    model.scale = nn.Parameter(torch.tensor([1.0 + 1e-12, 0.1], dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), ddiloco.session(model, optimizer, hub=hub(), learner_id=0,
                                                           inner_steps=8) as sync:
        while not sync.done:
            sync.step(tokens=4)
    assert sync.final_state == "done" and model.scale.dtype == torch.float64
    warnings = [r.getMessage() for r in caplog.records if "float64" in r.getMessage()]
    assert len(warnings) == 1
    assert "parameter 'scale' is float64 (1 in all)" in warnings[0]
    assert "synchronised in float32" in warnings[0]
    assert model.scale[0].item() == 1.0  # what float32 keeps of 1 + 1e-12: the warning's point


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_train_without_a_warning(dtype, caplog):
    model = TinyNet(seed=1).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), ddiloco.session(model, optimizer, hub=hub(), learner_id=0,
                                                           inner_steps=8) as sync:
        while not sync.done:
            sync.step(tokens=4)
    assert sync.final_state == "done" and all(p.dtype == dtype for p in model.parameters())
    assert "synchronised in float32" not in caplog.text


@pytest.mark.parametrize("deferred", [False, True], ids=["in_process", "publisher_thread"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_parameter_that_does_not_train_leaves_the_float32_global_value_exact(dtype, deferred):
    # A bf16 model started from float32 weights sent, at every sync, the rounding of the global value to bf16 as a
    # pseudo-gradient: frozen weights drifted by a bf16 step, and every update carried that noise.
    config = ddiloco.DilocoConfig(num_fragments=1, fragment_strategy="single", sync_every=2, codec="fp32",
                                  downlink_codec="fp32", outer_momentum=0.0)
    initial = params_of(TinyNet(seed=100))  # float32 values that bf16 and fp16 cannot hold
    assert any(not torch.equal(v, v.to(dtype).float()) for v in initial.values())
    syncer = Syncer(config, ddiloco.QuorumConfig(min_quorum=1, grace="none"), initial_params=initial)
    hub = InProcessHub(syncer, clock=VirtualClock())
    model = TinyNet(seed=0).to(dtype)
    learner = Learner(config, learner_id=0, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    hub.join(learner)
    learner.deferred = deferred
    for _ in range(4):  # two syncs; nothing changes the parameters
        hub.after_inner_step(learner, 4)
    assert syncer.rounds_committed == 2
    for name, value in syncer.global_params().items():
        assert torch.equal(value, initial[name]), name


def test_a_float16_parameter_whose_global_value_it_cannot_hold_is_refused_naming_it():
    # Loaded, 1e5 was infinite in float16: every update of its fragment was withheld as non-finite, and the learner
    # recovered by loading the same value again, for the whole run.
    initial = params_of(TinyNet(seed=100))
    name = next(iter(initial))
    initial[name].view(-1)[0] = 1e5
    syncer = Syncer(CONFIG, ddiloco.QuorumConfig(min_quorum=1), initial_params=initial)
    model = TinyNet(seed=0).half()
    with pytest.raises(TypeError, match=rf"parameter '{name}' is float16, and its global value \(\|x\| up to 100000\) "
                                        r"is out of float16's range \(65504\).*bfloat16 or float32"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=InProcessHub(syncer),
                        learner_id=0).start()
