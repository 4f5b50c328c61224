"""Does a learner's AdamW on a small batch train as data-parallel's does if its second moment is corrected to the
merged batch's noise? (docs/results.md, "Defaults and rounds", item 17; a measurement, nothing landed.)

Item 16 traced the gap to data-parallel to each learner's own AdamW on a quarter of data-parallel's batch: its second
moment holds M times the gradient-noise variance, so where noise dominates its steps are shorter. This prototype
divides that noise share by M, per coordinate, estimating it as the bias-corrected v - m^2:

    v_eff = v_hat - (1 - 1/M) * max(v_hat - m_hat^2, 0)

so that v_eff is about mean^2 + noise / M, the second moment of the mean gradient over M learners' batches. It costs
no bytes (each learner uses its own statistics). NOISE_M=1 is plain AdamW written the same way (a control: it runs
through the same code, so its difference from torch's AdamW is only float rounding).

    NOISE_M=4 .venv/bin/python benchmarks/bench_noise_adam.py --sweep --steps 896 --evals 6 --seed 0 \
        --jitter 0.05 --only dd:3e-3:0.7:0.5:16

Any `benchmarks/bench_sim.py` arguments are passed on; only the Decoupled learners' inner optimizer is replaced.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_sim  # noqa: E402

import ddiloco.sim.decoupled as decoupled  # noqa: E402
from ddiloco.training import InnerConfig  # noqa: E402

NOISE_M = float(os.environ.get("NOISE_M", "4"))


class NoiseCorrectedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with the second moment's noise share divided by
    `learners`."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float], weight_decay: float, learners: float,
                 eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.learners = learners

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - the harness never passes one
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(step=0, m=torch.zeros_like(param), v=torch.zeros_like(param))
                state["step"] += 1
                grad = param.grad
                state["m"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = state["m"] / (1 - beta1 ** state["step"])
                v_hat = state["v"] / (1 - beta2 ** state["step"])
                noise = (v_hat - m_hat * m_hat).clamp_(min=0)
                v_eff = v_hat - (1 - 1 / self.learners) * noise
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.addcdiv_(m_hat, v_eff.sqrt_().add_(group["eps"]), value=-group["lr"])


def noise_corrected_optimizer(model: torch.nn.Module, config: InnerConfig) -> torch.optim.Optimizer:
    return NoiseCorrectedAdamW(model.parameters(), lr=config.lr, betas=(config.beta1, config.beta2),
                               weight_decay=config.weight_decay, learners=NOISE_M)


if __name__ == "__main__":
    decoupled.make_inner_optimizer = noise_corrected_optimizer
    print(f"inner optimizer: AdamW with its second moment's noise share divided by {NOISE_M:g}")
    bench_sim.main(__doc__)
