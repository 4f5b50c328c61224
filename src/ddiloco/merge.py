"""Merging the learners' pseudo-gradients of one round into one.

- Token weighting ("quantity times quality"): w = tokens * (tokens / steps) = tokens^2 / steps, so a
  learner that trained more tokens, and more tokens per inner step, counts more.
- A cap on any one learner's weight (`cap_weights`): the weight is computed from counts the learner reports,
  so no learner may weigh more than k times the mean of a round's other participants, whatever it claims.
- Radial-directional averaging (RDA, Decoupled DiLoCo, arXiv 2604.21428): the learners' pseudo-
  gradients are nearly orthogonal, so their plain mean shrinks like 1/sqrt(M) and the outer learning
  rate would have to follow M. RDA keeps the size: the weighted mean of the norms times the unit
  vector of the weighted mean of the unit directions. Embedding tensors are not near-orthogonal
  across learners and use the plain weighted mean.

Everything here is a pure function of tensors and weights. The arithmetic (float32 sums in a stated order,
float64 scalars, the norms of `ddiloco.update_values.l2_norm`) is that of the syncer's streaming merge,
`ddiloco.round_sum`, which adds each update to the round's sums as it arrives.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from ddiloco.checks import invalid
from ddiloco.config import MERGE_METHODS
from ddiloco.messages import DecodedTensor
from ddiloco.round_sum import RoundSum
from ddiloco.update_values import l2_norm


def token_weight(tokens: int, steps: int) -> float:
    """tokens^2 / steps; a learner with no inner steps has weight 0."""
    if steps <= 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def cap_weights(weights: Sequence[float], max_ratio: float) -> list[float]:
    """`weights` with none above `max_ratio` (k) times the mean of the other positive weights: with n of them,
    no share above k / (k + n - 1). Each weight over the cap is lowered to exactly the cap and the others are
    kept, so what the heavy ones lose goes to the rest in proportion to their weights. Unchanged, bit for bit,
    when no weight is over the cap, when fewer than two are positive (one participant has share 1 by
    definition) and when all are zero. k = 1 makes every positive weight equal."""
    if not max_ratio >= 1:
        raise invalid("max_ratio", max_ratio, "a number >= 1")
    positive = sorted((float(w) for w in weights if w > 0), reverse=True)
    n = len(positive)
    # rests[j]: the sum of the j-th heaviest and all lighter ones, summed from the lightest (a total minus the
    # heavy ones would cancel to 0 beside a weight of 1e30).
    rests = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        rests[j] = rests[j + 1] + positive[j]
    clipped = 0
    # Water-filling, heaviest first: with the `clipped` heaviest at the cap, the next one fits if its share
    # (1 - clipped * cap) * w / rest is at most cap = k / (k + n - 1); multiplied out, that is the test below.
    # The lightest always fits (k >= 1), so the loop ends inside the list.
    while clipped < n - 1 and positive[clipped] * (n - 1 - (clipped - 1) * max_ratio) > max_ratio * rests[clipped]:
        clipped += 1
    if clipped == 0:
        return list(weights)
    # The weight whose share is exactly the cap, given the unclipped rest: k * rest / (n - 1 - (clipped - 1) * k),
    # k times the mean of the others when one is clipped (the denominator is > 0 whenever the loop clipped).
    limit = max_ratio * rests[clipped] / (n - 1 - (clipped - 1) * max_ratio)
    return [min(float(w), limit) for w in weights]


def _checked(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(deltas)} tensors but {len(weights)} weights")
    if not deltas:
        raise ValueError("cannot merge zero tensors")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0, got {list(weights)}")


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i v_i / sum_i w_i (zeros when every weight is 0), summed as `ddiloco.round_sum` says."""
    _checked(deltas, weights)
    return merge_round([{"v": d} for d in deltas], weights, method="mean")["v"]


def rda(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial-directional average: (sum w|v| / sum w) * unit(sum w v/|v|), summed as `ddiloco.round_sum` says.

    Zero vectors add to the mean norm (with norm 0) but contribute no direction; if every vector is
    zero, or the directions cancel exactly, the result is zero.
    """
    _checked(deltas, weights)
    return merge_round([{"v": d} for d in deltas], weights, method="rda")["v"]


def merge_round(updates: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], *,
                method: str = "rda", embeddings: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Merge per tensor: RDA (or the weighted mean when method='mean'); embeddings by weighted mean. The
    updates are summed in list order, with exactly the arithmetic of the syncer's streaming merge
    (`ddiloco.round_sum.RoundSum`), so this is its batch reference, bit for bit."""
    if method not in MERGE_METHODS:
        raise invalid("method", method, "'rda' or 'mean'")
    if not updates:
        raise ValueError("cannot merge a round with no updates")
    names = list(updates[0])
    for update in updates[1:]:
        if list(update) != names:
            raise ValueError("updates of one round must carry the same tensors in the same order")
    _checked(list(updates), weights)
    summed = RoundSum(names, method=method, embeddings=embeddings)
    for i, (update, weight) in enumerate(zip(updates, weights, strict=True)):
        values = {name: update[name].to(torch.float32) for name in names}
        summed.add(i, {name: DecodedTensor(v, l2_norm(v)) for name, v in values.items()}, float(weight))
    return summed.result({name: updates[0][name].shape for name in names})


def period_share(counts: Sequence[tuple[int, int, bool]], sync_every: int) -> float:
    """The share of an outer step a round takes: 1, unless it holds learners' last work (`final`, a
    partial period that ends training). Then it is the tokens carried over the tokens of a full period:
    sum of min(steps, H) x tokens/step over sum of H x tokens/step, a regular update counting as a full
    period. RDA keeps the merged norm of its updates, and a pseudo-gradient's norm does not shrink in
    proportion to its steps (the first steps after a fragment is overwritten move the most), so a round of
    a few last steps would otherwise weigh like a whole period: measured on examples/mlp.py, the final
    flush raised the validation loss by up to 30 % (benchmarks/bench_quality.py). The first rounds are not
    scaled (they are Streaming DiLoCo's), nor a fragment's first round that holds last work (`OpenRound.record`:
    with H at or above the budget it is the whole run). Recorded rounds hold the scaled merge (`RoundRecord.merged`), so
    replay is unchanged."""
    carried = expected = 0.0
    for steps, tokens, final in counts:
        per_step = tokens / steps
        carried += (min(steps, sync_every) if final else sync_every) * per_step
        expected += sync_every * per_step
    return carried / expected if expected > 0 else 1.0
