"""The close of a round in one pass per value: the outer Nesterov step and the int8 downlink change, fused.

The syncer's close is the outer optimizer's step (`ddiloco.outer`) followed by the downlink rule (`ddiloco.downlink`:
the change, its int8 encoding, the rebuilt global value, the residual). Written as torch operations that is about
ten passes over the fragment (a copy of the previous value, the step's four, the change's two, the encoding's and
the rebuild's), each a separate trip through memory. `ddiloco.kernels.nesterov_int8` does the same arithmetic, with
the same roundings, block by block while a block sits in cache: two passes over its inputs, one of which writes.

Used when the compiled kernels are built and the downlink codec is int8 (the default); otherwise, and for a round
whose change is not finite (the downlink then sends the exact value), the syncer takes the outer optimizer then the
downlink rule, which give the same bits (`tests/unit/test_fused_close.py`). A round whose step would not be finite
never gets here: the same kernel checks it first (`overflow`), without writing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ddiloco import kernels
from ddiloco.compression import Int8Codec
from ddiloco.downlink import DeltaDownlink, Downlink, fragment_checksum
from ddiloco.fragments import FragmentPlan
from ddiloco.kernels import KernelThreads
from ddiloco.messages import FragmentDelta
from ddiloco.outer import SAFE_BOUND, OuterOptimizer


class FusedClose:
    """The outer step and the int8 downlink change of a fragment, in one kernel per tensor (module docstring)."""

    def __init__(self, outer: OuterOptimizer, downlink: DeltaDownlink, plan: FragmentPlan,
                 global_tensors: list[dict[str, torch.Tensor]], threads: KernelThreads) -> None:
        assert isinstance(downlink.codec, Int8Codec), "the fused close encodes int8 only"
        self._outer = outer
        self._downlink = downlink
        self._plan = plan
        self._global = global_tensors
        self._threads = threads
        self._maxima: dict[tuple[int, str], tuple[float, float, float]] = {}
        """(fragment, tensor) -> the largest |momentum|, |parameter|, |residual| its last fused step wrote (the state
        holds them until anything else writes it: `forget`)."""

    def _run(self, fragment: int, name: str, merged: torch.Tensor, out: np.ndarray | None) -> kernels.CloseResult:
        lr, mu = self._outer.hyperparameters(fragment)
        param = self._global[fragment][name]
        momentum = self._outer.momentum(fragment, name) if mu != 0 else None
        first_step = mu != 0 and momentum is None
        if first_step and out is not None:
            momentum = torch.empty_like(param)  # written by the kernel: m' = g
        elif first_step:
            momentum = param  # a check reads no momentum at a first step; any tensor of the right size
        result = kernels.nesterov_int8(merged.to(torch.float32), momentum, param, self._downlink.residual(name), lr=lr,
                                       mu=mu, first_step=first_step, block_size=self._downlink.codec.block_size,
                                       out=out, threads=self._threads)
        if first_step and out is not None:
            self._outer.set_momentum(fragment, name, momentum)
        return result

    def _bounded(self, fragment: int, name: str, merged: torch.Tensor) -> bool:
        """Whether no new momentum, parameter or change of tensor `name` can leave float32's range: bounded from the
        largest values its last fused step wrote and the merged tensor's L2 norm (at least its largest value), in
        float64, against half of float32's largest value (far more than the few roundings need). One read of the
        merged tensor instead of the check's four."""
        held = self._maxima.get((fragment, name))
        if held is None:
            return False
        momentum_max, param_max, residual_max = held
        lr, mu = self._outer.hyperparameters(fragment)
        merged_max = kernels.l2_norm(merged.to(torch.float32), self._threads)
        momentum = abs(mu) * momentum_max + merged_max
        stepped = param_max + abs(lr) * (merged_max + abs(mu) * momentum)
        change = stepped + param_max + residual_max
        return max(momentum, change) < SAFE_BOUND  # False for NaN

    def check(self, fragment: int, merged: Mapping[str, torch.Tensor]) -> tuple[str | None, bool]:
        """(the first tensor whose momentum or parameter would stop being finite, or None; whether every change is
        finite), computed as the step would compute them, writing nothing: by the bound where it holds, else by the
        kernel's check."""
        changes_finite = True
        for name in self._plan.fragments[fragment]:
            if self._bounded(fragment, name, merged[name]):
                continue
            flags = self._run(fragment, name, merged[name], None).flags
            if flags & kernels.STEP_NOT_FINITE:
                return name, False
            changes_finite = changes_finite and not flags & kernels.CHANGE_NOT_FINITE
        return None, changes_finite

    def step(self, fragment: int, version: int, merged: Mapping[str, torch.Tensor]) -> FragmentDelta:
        """The step of `fragment` to `version`, in place, and its broadcast. `check` first: every change finite."""
        names = self._plan.fragments[fragment]
        codec = self._downlink.codec
        payload = {}
        for name in names:
            numel = self._global[fragment][name].numel()
            out = np.empty(codec.encoded_nbytes(numel), dtype=np.uint8)
            result = self._run(fragment, name, merged[name], out)
            assert not result.flags, "a change that is not finite: check() first"
            self._maxima[(fragment, name)] = (result.momentum_max, result.param_max, result.residual_max)
            payload[name] = out.tobytes()
        return FragmentDelta(fragment, version, version - 1, codec.name, payload,
                             fragment_checksum(self._global[fragment], names, self._threads))

    def forget(self, fragment: int | None = None) -> None:
        """Something else wrote `fragment`'s state (every fragment's: None): its bounds no longer hold."""
        self._maxima = {} if fragment is None else {k: v for k, v in self._maxima.items() if k[0] != fragment}


def make_fused_close(outer: OuterOptimizer, downlink: Downlink, plan: FragmentPlan,
                     global_tensors: list[dict[str, torch.Tensor]], threads: KernelThreads) -> FusedClose | None:
    """The fused close where it applies (the compiled kernels, an int8 downlink), else None: the syncer then takes
    the outer optimizer and the downlink rule."""
    if kernels.compiled is None or not isinstance(downlink, DeltaDownlink) or not isinstance(downlink.codec, Int8Codec):
        return None
    return FusedClose(outer, downlink, plan, global_tensors, threads)
