"""TinyGPT: parameter names and count, shapes, initial loss, causality, config checks, learning."""

import math

import pytest
import torch
import torch.nn.functional as F

from ddiloco.data import Batch
from ddiloco.model import ModelConfig, TinyGPT, build_model, count_parameters, estimate_loss

DEFAULT_PARAMETER_COUNT = 478_720


def _tokens(generator: torch.Generator, batch: int, length: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=generator)


def test_default_parameter_count_matches_arithmetic():
    V, T, C, L, R = 256, 128, 128, 2, 4
    per_block = (2 * C) + (C * 3 * C + 3 * C) + (C * C + C) + (2 * C) + (C * R * C + R * C) + (R * C * C + C)
    expected = V * C + T * C + L * per_block + 2 * C + C * V
    assert expected == DEFAULT_PARAMETER_COUNT
    torch.manual_seed(0)
    assert count_parameters(build_model()) == DEFAULT_PARAMETER_COUNT


def test_parameter_names_are_the_documented_interface():
    torch.manual_seed(0)
    names = [name for name, _ in build_model(ModelConfig(num_layers=2)).named_parameters()]
    block = [
        "attn_norm.weight",
        "attn_norm.bias",
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "mlp_norm.weight",
        "mlp_norm.bias",
        "mlp.fc.weight",
        "mlp.fc.bias",
        "mlp.proj.weight",
        "mlp.proj.bias",
    ]
    expected = (
        ["token_embedding.weight", "position_embedding.weight"]
        + [f"blocks.{i}.{name}" for i in range(2) for name in block]
        + ["final_norm.weight", "final_norm.bias", "lm_head.weight"]
    )
    assert names == expected


def test_embedding_and_output_weights_are_distinct_tensors():
    torch.manual_seed(0)
    model = build_model()
    params = dict(model.named_parameters())
    assert params["token_embedding.weight"].data_ptr() != params["lm_head.weight"].data_ptr()
    # every parameter owns its own storage, so fragments cut by name never alias
    pointers = [p.data_ptr() for p in model.parameters()]
    assert len(set(pointers)) == len(pointers)


def test_init_is_deterministic_given_manual_seed():
    torch.manual_seed(7)
    first = build_model().state_dict()
    torch.manual_seed(7)
    second = build_model().state_dict()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_output_shapes_and_no_loss_without_targets():
    torch.manual_seed(0)
    model = build_model(ModelConfig(context_len=16, width=32, num_heads=2))
    idx_BT = _tokens(torch.Generator().manual_seed(1), batch=3, length=10)
    logits_BTV, loss = model(idx_BT)
    assert logits_BTV.shape == (3, 10, 256)
    assert loss is None
    _, loss = model(idx_BT, idx_BT)
    assert loss.shape == ()


def test_loss_matches_cross_entropy_written_out():
    torch.manual_seed(0)
    model = build_model(ModelConfig(context_len=16, width=32, num_heads=2))
    generator = torch.Generator().manual_seed(2)
    idx_BT, targets_BT = _tokens(generator, 2, 8), _tokens(generator, 2, 8)
    logits_BTV, loss = model(idx_BT, targets_BT)
    log_probs = F.log_softmax(logits_BTV, dim=-1)
    expected = -log_probs.gather(-1, targets_BT[..., None]).mean()
    torch.testing.assert_close(loss, expected)


def test_loss_at_init_is_near_uniform():
    torch.manual_seed(0)
    model = build_model()
    generator = torch.Generator().manual_seed(3)
    _, loss = model(_tokens(generator, 4, 128), _tokens(generator, 4, 128))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal():
    torch.manual_seed(0)
    model = build_model(ModelConfig(context_len=16, width=32, num_heads=4))
    idx_BT = _tokens(torch.Generator().manual_seed(4), batch=2, length=12)
    changed_BT = idx_BT.clone()
    t = 7
    changed_BT[:, t] = (changed_BT[:, t] + 1) % 256
    logits_before, _ = model(idx_BT)
    logits_after, _ = model(changed_BT)
    torch.testing.assert_close(logits_after[:, :t], logits_before[:, :t])
    assert not torch.allclose(logits_after[:, t:], logits_before[:, t:])


def test_sequence_longer_than_context_is_rejected():
    torch.manual_seed(0)
    model = build_model(ModelConfig(context_len=8, width=16, num_heads=2))
    with pytest.raises(ValueError, match="context_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 0}, "vocab_size=0 is invalid: expected an integer >= 1"),
        ({"context_len": -1}, "context_len=-1 is invalid: expected an integer >= 1"),
        ({"width": 0}, "width=0 is invalid: expected an integer >= 1"),
        ({"num_layers": 0}, "num_layers=0 is invalid: expected an integer >= 1"),
        ({"num_heads": 0}, "num_heads=0 is invalid: expected an integer >= 1"),
        ({"mlp_ratio": 0}, "mlp_ratio=0 is invalid: expected an integer >= 1"),
        ({"width": 2.5}, "width=2.5 is invalid: expected an integer >= 1"),
        ({"num_layers": True}, "num_layers=True is invalid: expected an integer >= 1"),
        ({"width": 130, "num_heads": 4}, "width must be divisible by num_heads, got width=130, num_heads=4"),
        ({"dropout": 1.0}, "dropout must be a number in [0, 1), got 1.0"),
        ({"dropout": -0.1}, "dropout must be a number in [0, 1), got -0.1"),
    ],
)
def test_config_validation_names_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        ModelConfig(**kwargs)
    assert str(excinfo.value) == message


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(256)  # type: ignore[misc]
    config = ModelConfig()
    with pytest.raises(AttributeError):
        config.width = 64  # type: ignore[misc]


def test_a_few_adamw_steps_on_one_batch_reduce_the_loss():
    torch.manual_seed(0)
    model = build_model()
    generator = torch.Generator().manual_seed(5)
    idx_BT = _tokens(generator, 4, 33, vocab=64)
    inputs_BT, targets_BT = idx_BT[:, :-1], idx_BT[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _, initial = model(inputs_BT, targets_BT)
    for _ in range(10):
        _, loss = model(inputs_BT, targets_BT)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _, final = model(inputs_BT, targets_BT)
    assert final.item() < initial.item() - 1.0


def test_estimate_loss_weights_by_tokens_and_restores_mode():
    torch.manual_seed(0)
    model = build_model(ModelConfig(context_len=16, width=32, num_heads=2, dropout=0.1))
    generator = torch.Generator().manual_seed(6)
    batches = []
    for size in (4, 1):
        window_BW = _tokens(generator, size, 17)
        batches.append(Batch(inputs=window_BW[:, :-1], targets=window_BW[:, 1:], tokens=size * 16))
    model.train()
    estimate = estimate_loss(model, batches)
    assert model.training

    model.eval()
    with torch.no_grad():
        losses = [model(b.inputs, b.targets)[1].item() for b in batches]
    expected = (losses[0] * 64 + losses[1] * 16) / 80
    assert estimate == pytest.approx(expected, rel=1e-6)
    assert estimate_loss(model, batches) == pytest.approx(expected, rel=1e-6)
    assert not model.training


def test_estimate_loss_rejects_no_batches():
    torch.manual_seed(0)
    model = build_model(ModelConfig(context_len=8, width=16, num_heads=2))
    with pytest.raises(ValueError, match="at least one batch"):
        estimate_loss(model, [])


def test_tiny_gpt_takes_a_config():
    model = TinyGPT(ModelConfig(num_layers=1))
    assert len(model.blocks) == 1
