"""The outer optimizer: SGD with Nesterov momentum on each fragment of the global parameters.

DiLoCo (arXiv 2311.08105) feeds the merged pseudo-gradient Delta = base - local to Nesterov SGD as
if it were a gradient: m <- mu*m + Delta; Theta <- Theta - eta*(Delta + mu*m). That is
`torch.optim.SGD(nesterov=True)`, whose instances (one per fragment, so a fragment's round touches only that
fragment's parameters and momentum) hold the state and its checkpoint format. The step itself is written out with
every product and sum rounded on its own, in float32: m = m * mu + Delta (m = Delta at the first step),
u = Delta + m * mu, Theta = Theta - u * eta. torch's SGD computes the last two with `add(alpha=...)`, which is a fused
multiply-add on AVX2 CPUs and two roundings elsewhere, so its bits depend on the machine; these do not, and they are
what the syncer's fused close computes (`ddiloco.kernels.nesterov_int8`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch

SAFE_BOUND = 0.5 * torch.finfo(torch.float32).max
"""A step whose bound on every result stays below this cannot overflow float32, roundings included."""


def _absmax(tensor: torch.Tensor) -> float:
    """max |x| as a Python float; NaN when a value is NaN. One reduction pass: `isfinite(x).all()` allocates a
    bool per value and is about twenty times slower."""
    if tensor.numel() == 0:
        return 0.0
    low, high = (float(v) for v in torch.aminmax(tensor))  # NaN propagates into both, Inf into one
    return math.nan if math.isnan(low) or math.isnan(high) else max(high, -low)


class OuterOptimizer:
    """One Nesterov SGD per fragment over the syncer's float32 global tensors."""

    def __init__(self, fragments: Sequence[Mapping[str, torch.Tensor]], *, lr: float, momentum: float) -> None:
        self._names = [list(tensors) for tensors in fragments]
        self._params = [list(tensors.values()) for tensors in fragments]
        self._by_name = [dict(tensors) for tensors in fragments]
        """Per fragment, its tensors by name: a fused close asks for each tensor's momentum by name (a list's index()
        made that quadratic in a fragment's tensors: 2.2 s of a round at 10 k tensors)."""
        # Nesterov needs momentum > 0 in torch; momentum 0 is plain SGD, which is the same formula.
        self._optimizers = [
            torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
            for params in self._params
        ]

    @torch.no_grad()
    def step(self, fragment: int, merged: Mapping[str, torch.Tensor]) -> None:
        optimizer = self._optimizers[fragment]
        lr, mu = self.hyperparameters(fragment)
        for name, param in zip(self._names[fragment], self._params[fragment], strict=True):
            update = merged[name].to(dtype=param.dtype)
            if mu != 0:
                state = optimizer.state[param]
                momentum = state.get("momentum_buffer")
                if momentum is None:
                    state["momentum_buffer"] = momentum = update.clone()
                else:
                    momentum.mul_(mu).add_(update)
                update = update + momentum * mu
            param.sub_(update * lr)

    def hyperparameters(self, fragment: int) -> tuple[float, float]:
        """(learning rate, momentum) of `fragment`'s step."""
        group = self._optimizers[fragment].param_groups[0]
        return float(group["lr"]), float(group["momentum"])

    def momentum(self, fragment: int, name: str) -> torch.Tensor | None:
        """The momentum of tensor `name` of `fragment` (None before its first step, or with momentum 0)."""
        param = self._by_name[fragment][name]
        return self._optimizers[fragment].state.get(param, {}).get("momentum_buffer")

    def set_momentum(self, fragment: int, name: str, momentum: torch.Tensor) -> None:
        """Hold `momentum` as tensor `name`'s momentum (the fused close writes a first step's into it)."""
        param = self._by_name[fragment][name]
        self._optimizers[fragment].state[param]["momentum_buffer"] = momentum

    @torch.no_grad()
    def non_finite_result(self, fragment: int, merged: Mapping[str, torch.Tensor]) -> str | None:
        """The first tensor whose momentum or parameter would stop being finite if `merged` were applied to
        `fragment` (the same Nesterov formula as `step`, computed aside), or None. Values that are each
        finite can still overflow float32 in the step: a round that would do so must not commit."""
        optimizer = self._optimizers[fragment]
        lr, mu = self.hyperparameters(fragment)
        for name, param in zip(self._names[fragment], self._params[fragment], strict=True):
            grad = merged[name].to(dtype=param.dtype)
            grad_max = _absmax(grad)
            if not math.isfinite(grad_max):
                return name
            buffer = optimizer.state.get(param, {}).get("momentum_buffer") if mu > 0 else None
            buffer_max = 0.0 if buffer is None else _absmax(buffer)
            # |new momentum| <= mu |m| + |g|, |new param| <= |p| + lr (|g| + mu |new momentum|): far below
            # float32's largest value, no value can overflow (the usual case, three reductions instead of the step).
            momentum_bound = mu * buffer_max + grad_max
            if _absmax(param) + abs(lr) * (grad_max + mu * momentum_bound) < SAFE_BOUND:
                continue
            if mu > 0:
                momentum = grad.clone() if buffer is None else buffer * mu + grad
                if not math.isfinite(_absmax(momentum)):
                    return name
                grad = grad + momentum * mu
            if not math.isfinite(_absmax(param - grad * lr)):
                return name
        return None

    def state_dict(self) -> list[dict]:
        # A deep copy: torch returns live references to the momentum buffers, and a state dict
        # loaded into a second optimizer would otherwise share (and double-update) them.
        return copy.deepcopy([opt.state_dict() for opt in self._optimizers])

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self._optimizers):
            raise ValueError(f"outer optimizer state has {len(states)} fragments, expected "
                             f"{len(self._optimizers)}")
        for opt, state in zip(self._optimizers, states, strict=True):
            opt.load_state_dict(state)
