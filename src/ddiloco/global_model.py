"""The syncer's global model: each fragment's values and version, the outer optimizer's momentum, the downlink's
residual, and the one way they change, an outer step of a fragment to its next version.

`Syncer` decides when a round closes and what it merged; this owns what that does to the model, in two equivalent
ways that give the same bits: the fused close (`ddiloco.fused_close`: the int8 downlink's Nesterov step, check and
encoding in one C pass) and the eager one (`OuterOptimizer.step`, then the downlink rule of `ddiloco.downlink`, which
makes the global value what every learner rebuilds). `state_dict` is this part of the syncer's full state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ddiloco.config import DilocoConfig
from ddiloco.downlink import make_downlink
from ddiloco.fragments import FragmentPlan
from ddiloco.fused_close import make_fused_close
from ddiloco.kernel_threads import KernelThreads
from ddiloco.messages import FragmentDelta, FragmentState
from ddiloco.outer import OuterOptimizer
from ddiloco.state_plan import plan_difference, plan_refusal


class GlobalModel:
    """The global values of every fragment, at their versions, with the outer step's state."""

    def __init__(self, config: DilocoConfig, plan: FragmentPlan, initial_params: Mapping[str, torch.Tensor], *,
                 threads: KernelThreads) -> None:
        self.plan = plan
        # Contiguous copies: a model's parameter may be a strided view (`nn.Parameter(w.t())`), and the kernels
        # write the global values in place as flat runs.
        self.values = [{name: initial_params[name].detach().to("cpu", torch.float32, copy=True,
                                                                memory_format=torch.contiguous_format)
                        for name in names} for names in plan.fragments]
        """Per fragment, its global tensors by name, changed in place by each outer step."""
        shapes = {name: tuple(t.shape) for name, t in initial_params.items()}
        self.outer = OuterOptimizer(self.values, lr=config.outer_lr, momentum=config.outer_momentum)
        self.downlink = make_downlink(config.downlink_codec, plan, shapes)
        self.fused_close = make_fused_close(self.outer, self.downlink, plan, self.values, threads)
        """None where the fused close does not apply (no int8 downlink, or the kernels not built)."""
        counts = [sum(t.numel() for t in tensors.values()) for tensors in self.values]
        self.fragment_shares = [count / sum(counts) if sum(counts) else 1 / len(counts) for count in counts]
        """Each fragment's share of the model's values (they sum to 1; all equal for a model without values)."""
        self.versions = [0] * plan.num_fragments

    def params(self) -> dict[str, torch.Tensor]:
        """A copy of the whole global model, by parameter name."""
        return {name: t.clone() for frag in self.values for name, t in frag.items()}

    def fragment_state(self, fragment: int) -> FragmentState:
        # A snapshot: later rounds update the global tensors in place, and a state may sit in a
        # simulated link (or a send queue) for a while before it is applied.
        tensors = {name: t.clone() for name, t in self.values[fragment].items()}
        return FragmentState(fragment, self.versions[fragment], tensors)

    def check_step(self, p: int, merged: Mapping[str, torch.Tensor]) -> tuple[str | None, bool]:
        """(the first tensor the outer step of fragment p with `merged` would make non-finite, or None; whether the
        fused close can take the step, `ddiloco.fused_close`)."""
        if self.fused_close is None:
            return self.outer.non_finite_result(p, merged), False
        return self.fused_close.check(p, merged)

    def step(self, p: int, merged: Mapping[str, torch.Tensor], version: int, *,
             fused: bool | None = None) -> FragmentState | FragmentDelta:
        """The outer step of fragment p to `version`, through the downlink rule (`ddiloco.downlink`: with a lossy
        downlink codec the global value becomes what learners rebuild); returns the round's broadcast. `fused`:
        whether `check_step` allowed the fused close (None: not checked yet). Both ways give the same bits."""
        if fused is None and self.fused_close is not None:
            fused = self.check_step(p, merged)[1]
        if fused:
            assert self.fused_close is not None
            self.versions[p] = version
            return self.fused_close.step(p, version, merged)
        if self.fused_close is not None:
            self.fused_close.forget(p)
        previous = self.downlink.before_step(p, self.values[p])
        self.outer.step(p, merged)
        self.versions[p] = version
        return self.downlink.after_step(p, version, previous, self.values[p])

    def state_dict(self) -> dict:
        return {
            "versions": list(self.versions),
            "global": self.params(),
            "outer": self.outer.state_dict(),
            "downlink_residual": self.downlink.state_dict(),
            "fragments": [list(names) for names in self.plan.fragments],
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        """ValueError (`ddiloco.state_plan`) when `state` was written with another fragment plan."""
        difference = plan_difference(state, self.plan, self.values)
        if difference is not None:
            raise plan_refusal(difference)
        for frag in self.values:
            for name, tensor in frag.items():
                tensor.copy_(state["global"][name])
        self.versions = [int(v) for v in state["versions"]]
        self.outer.load_state_dict(state["outer"])
        self.downlink.load_state_dict(state["downlink_residual"])
        if self.fused_close is not None:
            self.fused_close.forget()
