import math

import pytest
import torch

from ddiloco.merge import merge_round, rda, token_weight, weighted_mean


def test_token_weight_is_quantity_times_quality():
    assert token_weight(tokens=100, steps=10) == 1000.0
    # Twice the tokens per step at equal steps: 4x the weight.
    assert token_weight(200, 10) == 4 * token_weight(100, 10)
    assert token_weight(100, 0) == 0.0


def test_weighted_mean_by_hand():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    torch.testing.assert_close(weighted_mean([a, b], [1.0, 3.0]), torch.tensor([2.5, -1.0]))
    torch.testing.assert_close(weighted_mean([a, b], [0.0, 0.0]), torch.zeros(2))


@pytest.mark.parametrize("count", [2, 4, 8])
def test_rda_keeps_the_norm_of_equal_norm_orthogonal_inputs(count):
    vectors = [torch.eye(count)[i] * 3.0 for i in range(count)]
    weights = [1.0] * count
    assert float(torch.linalg.vector_norm(rda(vectors, weights))) == pytest.approx(3.0, rel=1e-6)
    # The plain mean shrinks like 1/sqrt(M): what RDA is for.
    mean_norm = float(torch.linalg.vector_norm(weighted_mean(vectors, weights)))
    assert mean_norm == pytest.approx(3.0 / math.sqrt(count), rel=1e-6)


def test_rda_matches_the_formula_on_random_vectors():
    generator = torch.Generator().manual_seed(1)
    vectors = [torch.randn(50, generator=generator) * s for s in (1.0, 2.0, 0.5)]
    weights = [1.0, 2.0, 3.0]
    total = sum(weights)
    norms = [float(v.norm()) for v in vectors]
    mean_norm = sum(w * n for w, n in zip(weights, norms, strict=True)) / total
    direction = sum(w * v / n for w, v, n in zip(weights, vectors, norms, strict=True)) / total
    expected = mean_norm * direction / direction.norm()
    torch.testing.assert_close(rda(vectors, weights), expected, rtol=1e-5, atol=1e-6)


def test_rda_zero_vectors_add_no_direction():
    v = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(rda([v, torch.zeros(2)], [1.0, 1.0]), 0.5 * v)
    torch.testing.assert_close(rda([torch.zeros(2), torch.zeros(2)], [1.0, 1.0]), torch.zeros(2))


def test_merge_round_uses_weighted_mean_for_embeddings():
    a = {"emb": torch.tensor([1.0, 0.0]), "w": torch.tensor([1.0, 0.0])}
    b = {"emb": torch.tensor([0.0, 1.0]), "w": torch.tensor([0.0, 1.0])}
    merged = merge_round([a, b], [1.0, 1.0], method="rda", embeddings={"emb"})
    torch.testing.assert_close(merged["emb"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(merged["w"], torch.tensor([1.0, 1.0]) / math.sqrt(2))
    plain = merge_round([a, b], [1.0, 1.0], method="mean")
    torch.testing.assert_close(plain["w"], torch.tensor([0.5, 0.5]))


def test_merge_rejects_bad_input():
    with pytest.raises(ValueError, match="2 tensors but 1 weights"):
        rda([torch.zeros(1), torch.zeros(1)], [1.0])
    with pytest.raises(ValueError, match="method='avg'"):
        merge_round([{"w": torch.zeros(1)}], [1.0], method="avg")
    with pytest.raises(ValueError, match=">= 0"):
        weighted_mean([torch.zeros(1)], [-1.0])


def test_a_round_of_last_work_takes_the_share_of_a_period_its_tokens_carry():
    from ddiloco.merge import period_share
    # A learner's last 8 of H = 16 steps (2 tokens per step) beside a regular update: 3/4 of a period.
    assert period_share([(8, 16, True), (16, 32, False)], 16) == 0.75
    # Regular updates always count as a full period, however few steps (the first rounds are not scaled).
    assert period_share([(4, 8, False), (4, 8, False)], 16) == 1.0
    # Last work longer than H counts as one full period, not more.
    assert period_share([(40, 40, True)], 16) == 1.0
