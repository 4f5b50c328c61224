import math

import pytest
import torch

from ddiloco.merge import cap_weights, merge_round, rda, token_weight, weighted_mean


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


def _shares(weights):
    total = sum(weights)
    return [w / total for w in weights]


def test_a_round_within_the_cap_keeps_its_weights_bit_for_bit():
    for weights in ([5.0], [3.0, 3.0], [1.0, 1.0, 1.0, 1.0], [4.0, 1.0], [16.0, 1.0, 1.0, 1.0]):
        assert cap_weights(weights, max_ratio=16.0) == weights
    # One participant has share 1 by definition; all-zero weights merge to zero and stay so.
    assert cap_weights([8.1e31], max_ratio=1.0) == [8.1e31]
    assert cap_weights([0.0, 0.0], max_ratio=1.0) == [0.0, 0.0]
    # A zero weight is no participant to compare with: the one positive weight is alone.
    assert cap_weights([8.1e31, 0.0], max_ratio=4.0) == [8.1e31, 0.0]


def test_the_cap_lowers_an_outlier_to_max_ratio_times_the_mean_of_the_others():
    # 8.1e31 (2**53 tokens in one step) against 4.2e7: the honest learner had share 5e-25.
    capped = cap_weights([8.1e31, 4.2e7], max_ratio=16.0)
    assert capped == [16.0 * 4.2e7, 4.2e7]
    assert _shares(capped)[0] == pytest.approx(16 / 17, rel=1e-12)
    # With n participants, an outlier's share is at most k / (k + n - 1): here 16 / 19.
    capped = cap_weights([1e30, 2.0, 3.0, 4.0], max_ratio=16.0)
    assert capped[1:] == [2.0, 3.0, 4.0]
    assert capped[0] == pytest.approx(16.0 * 3.0, rel=1e-12)
    assert _shares(capped)[0] == pytest.approx(16 / 19, rel=1e-12)
    # The others' sum is taken from the lightest up: 1e30 + 1 + 1 - 1e30 would be 0 in floating point.
    assert cap_weights([1e30, 1.0, 1.0], max_ratio=16.0) == [16.0, 1.0, 1.0]


def test_several_outliers_are_capped_together_and_the_rest_keep_their_proportions():
    # k = 2 with 5 participants: no share above 2 / 6; the two outliers take exactly that, the others
    # share the last third in their own proportions.
    capped = cap_weights([1e20, 5e19, 1.0, 3.0, 6.0], max_ratio=2.0)
    assert capped == [10.0, 10.0, 1.0, 3.0, 6.0]
    for i, w in enumerate(capped):
        others = [x for j, x in enumerate(capped) if j != i]
        assert w <= 2.0 * sum(others) / len(others)
    # A ratio of 1 makes every positive weight equal.
    assert cap_weights([9.0, 3.0, 1.0], max_ratio=1.0) == [1.0, 1.0, 1.0]


def test_cap_weights_refuses_a_ratio_below_one():
    with pytest.raises(ValueError, match="max_ratio=0.5"):
        cap_weights([1.0, 2.0], max_ratio=0.5)
