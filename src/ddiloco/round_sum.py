"""The streaming merge of one round: running sums per tensor, added to as updates arrive.

An open round holds one float32 tensor per tensor of its fragment, however many updates it collects
(before: every learner's decoded pseudo-gradient until the round closed), and closing it costs one pass
over the fragment instead of M. `ddiloco.merge.merge_round` is the same arithmetic applied to a list, so a
round merged as it streams in and the batch merge of the same updates in the same order agree bit for bit.

The formulation (RDA: Decoupled DiLoCo, arXiv 2604.21428; see `ddiloco.merge` for why). Contributions
i = 1..m in summation order, each with decoded values d_i, their L2 norm n_i (`ddiloco.update_values`) and
weight w_i >= 0. With r the first positive weight in that order, c_i = w_i / r (float64: raw token weights
reach 1e14, and the sums stay near the size of the values):

    RDA tensor:    D = sum of (c_i / n_i) d_i over i with c_i > 0 and n_i > 0     float32, in order
                   (and c_i / n_i finite in float32: a norm in its subnormal range, below about c_i * 3e-39,
                   counts as a norm of 0, as its direction would be infinite)
                   N = sum of c_i n_i,  C = sum of c_i                            float64, in order
                   result = D * ((N / C) / ||D||)       (zeros when C = 0 or ||D|| = 0; ||.||: `l2_norm`)
    weighted mean: S = sum of c_i d_i over i with c_i > 0                         float32, in order
                   result = S / C                        (zeros when C = 0)

A cap on an update's norm (`cap`, from `QuorumConfig.max_norm_ratio`): an update whose norm over the whole fragment,
u_i = sqrt(sum over its tensors of n_i^2), is above the cap k counts as if its values were scaled by s_i = k / u_i.
For an RDA tensor that is n_i -> s_i n_i in N (its direction is a unit vector either way); for a weighted mean, the
coefficient c_i becomes c_i s_i, rounded to float32 as any coefficient. `reference_norm` gives the weighted mean of
u_i over the updates that were not capped (the cap itself when every one was): what the syncer keeps as the
fragment's next reference. A capped update does not raise it, so one learner sending huge updates round after round
keeps meeting the same cap.

"In order" means: the first term is `d * a` (a new tensor), each later one `acc + (d * a)`, where a is the
coefficient above rounded to float32, and the product and the sum are each rounded to float32 (no fused
multiply-add: `ddiloco.kernels.accumulate`, which adds an int4 update straight from its codes). ||.|| is
`ddiloco.kernels.l2_norm`. The syncer sums a round in the order its learners' updates
arrived; the order is recorded (`RoundRecord.summed`). Replay never sums again: the round log holds each
round's merged tensors.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Mapping, Sequence

import torch

from ddiloco import kernels
from ddiloco.checks import invalid
from ddiloco.config import MERGE_METHODS
from ddiloco.kernel_threads import INLINE, KernelThreads
from ddiloco.messages import DecodedTensor

_FLOAT32_MAX = torch.finfo(torch.float32).max
"""The largest factor a term may have: the kernels round it to float32, where a larger one is infinite."""


class RoundSum:
    """Running sums of one round's updates (see the module docstring). Add updates with `add`, take the
    merged tensors once with `result`. `invalidate` drops the sums of a round that must be summed again (one
    of its updates was replaced); later `add`s are then ignored and `holds` is False."""

    def __init__(self, names: Sequence[str], *, method: str = "rda", embeddings: Collection[str] = (),
                 threads: KernelThreads = INLINE, cap: float | None = None) -> None:
        """`threads`: where the sums' passes run (`ddiloco.kernel_threads`; the same bits on any number). `cap`: the
        most norm an update counts with, over all its tensors (module docstring); None: no cap."""
        if method not in MERGE_METHODS:
            raise invalid("method", method, "'rda' or 'mean'")
        self.names = list(names)
        self._rda = {name: method == "rda" and name not in embeddings for name in self.names}
        self._cap = cap
        self.capped: list[tuple[Hashable, float]] = []
        """(key, norm) of every update whose norm was capped, in the order they were added."""
        self._sums: dict[str, torch.Tensor] | None = {}
        self._norm_sums = dict.fromkeys(self.names, 0.0)
        self._uncapped = [0.0, 0.0]
        """[sum of c_i u_i, sum of c_i] over the updates whose norm was not capped."""
        self._reference: float | None = None
        self._total = 0.0
        self.keys: list[Hashable] = []
        self.weights: list[float] = []
        self._threads = threads

    def add(self, key: Hashable, tensors: Mapping[str, DecodedTensor], weight: float) -> None:
        """Add one update (its tensors decoded and checked) with `weight` (>= 0), after those added before."""
        if not weight >= 0:
            raise invalid("weight", weight, "a number >= 0")
        self.keys.append(key)
        self.weights.append(weight)
        if self._sums is None:
            return
        if weight > 0 and self._reference is None:
            self._reference = weight
        if self._reference is None:
            return  # no positive weight yet: a zero weight adds nothing, to any sum
        coefficient = weight / self._reference
        self._total += coefficient
        if coefficient == 0.0:
            return
        norm = math.sqrt(sum(tensors[name].norm ** 2 for name in self.names))
        scale = 1.0
        if self._cap is not None and norm > self._cap:
            self.capped.append((key, norm))
            scale = self._cap / norm
        else:
            self._uncapped[0] += coefficient * norm
            self._uncapped[1] += coefficient
        terms = []
        for name in self.names:
            tensor = tensors[name]
            if self._rda[name]:
                self._norm_sums[name] += coefficient * (tensor.norm * scale if scale != 1.0 else tensor.norm)
                if tensor.norm > 0.0 and coefficient / tensor.norm <= _FLOAT32_MAX:
                    terms.append(self._term(name, tensor.values, coefficient / tensor.norm))
            else:
                terms.append(self._term(name, tensor.values, coefficient * scale if scale != 1.0 else coefficient))
        kernels.accumulate_all(terms, self._threads)  # every tensor of the update handed to the threads at once

    def _term(self, name: str, values: torch.Tensor | kernels.Int4Blocks, alpha: float) -> kernels.Term:
        assert self._sums is not None
        held = self._sums.get(name)
        first = held is None
        if first:
            numel = values.numel if isinstance(values, kernels.Int4Blocks) else values.numel()
            held = self._sums[name] = torch.empty(numel, dtype=torch.float32)
        return held, values if isinstance(values, kernels.Int4Blocks) else values.reshape(-1), alpha, first

    def invalidate(self) -> None:
        self._sums = None

    def reference_norm(self) -> float | None:
        """The weighted mean norm of the updates added that were not capped, or the cap when every one was (module
        docstring); None before a positive weight."""
        if self._total == 0.0:
            return None
        norms, total = self._uncapped
        return norms / total if total > 0.0 else self._cap

    def holds(self, keys: Sequence[Hashable], weights: Sequence[float]) -> bool:
        """Whether the sums are valid and hold exactly `keys` with `weights`, in this order."""
        return self._sums is not None and self.keys == list(keys) and self.weights == list(weights)

    def result(self, shapes: Mapping[str, torch.Size | tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The merged tensors (float32; `shapes` gives those of tensors no term reached, which are zeros). The
        sums become the result: call once."""
        if self._sums is None:
            raise RuntimeError("the round's sums were invalidated: sum it again")
        merged = {}
        rda = [name for name in self.names if self._rda[name] and self._sums.get(name) is not None]
        direction_norms = dict(zip(rda, kernels.l2_norms([self._sums[n] for n in rda], self._threads), strict=True))
        scalings = []  # (sum, factor, divide), in place: on the threads at once, with no torch parallel region
        for name in self.names:
            held = self._sums.get(name)
            if held is None or self._total == 0.0:
                merged[name] = torch.zeros(shapes[name], dtype=torch.float32)
                continue
            merged[name] = held.view(shapes[name])
            if self._rda[name]:
                direction_norm = direction_norms[name]
                if direction_norm == 0.0:
                    held.zero_()
                else:
                    scalings.append((held, (self._norm_sums[name] / self._total) / direction_norm, False))
            else:
                scalings.append((held, self._total, True))
        kernels.scale_all(scalings, self._threads)
        self._sums = None
        return merged
