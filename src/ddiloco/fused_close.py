"""The close of a round in one pass per value: the outer Nesterov step and the int8 downlink change, fused.

The syncer's close is the outer optimizer's step (`ddiloco.outer`) followed by the downlink rule (`ddiloco.downlink`:
the change, its int8 encoding, the rebuilt global value, the residual). Written as torch operations that is about
ten passes over the fragment (a copy of the previous value, the step's four, the change's two, the encoding's and
the rebuild's), each a separate trip through memory. `ddiloco.kernels.nesterov_int8` does the same arithmetic, with
the same roundings, block by block while a block sits in cache: two passes over its inputs, one of which writes.

Before a round commits, `check` says whether its step would leave float32's range (the round is then not a round)
and whether every change stays finite: from a bound where one holds (the largest values the tensor's last fused
step wrote, and the merged tensor's norm: one read of one tensor), else by the same kernel run without writing
(four reads).

Used when the compiled kernels are built and the downlink codec is int8 (the default); otherwise, and for a round
whose change is not finite (the downlink then sends the exact value), the syncer takes the outer optimizer then the
downlink rule, which give the same bits (`tests/unit/test_fused_close.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from ddiloco import kernels
from ddiloco.compression import Int8Codec
from ddiloco.downlink import DeltaDownlink, Downlink, fragment_checksum
from ddiloco.fragments import FragmentPlan
from ddiloco.kernel_threads import KernelThreads
from ddiloco.messages import FragmentDelta
from ddiloco.outer import SAFE_BOUND, OuterOptimizer
from ddiloco.zero_encodings import zero_names

logger = logging.getLogger(__name__)


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
        self._payloads: dict[str, np.ndarray | None] = {}
        self._maxima: dict[tuple[int, str], tuple[float, float, float]] = {}
        """(fragment, tensor) -> the largest |momentum|, |parameter|, |residual| its last fused step wrote (the state
        holds them until anything else writes it: `forget`)."""

    def _batch(self, fragment: int, names: list[str], merged: Mapping[str, torch.Tensor],
               write: bool) -> list[kernels.CloseResult]:
        """The kernel over tensors `names` of `fragment`, all handed to the threads at once: checking, or writing (the
        payloads in `self._payloads`)."""
        lr, mu = self._outer.hyperparameters(fragment)
        batch = []
        for name in names:
            param = self._global[fragment][name]
            momentum = self._outer.momentum(fragment, name) if mu != 0 else None
            first_step = mu != 0 and momentum is None
            if first_step:  # written by the kernel (m' = g); a check reads none, so any tensor of the size will do
                momentum = torch.empty_like(param) if write else param
                if write:
                    self._outer.set_momentum(fragment, name, momentum)
            out = np.empty(self._downlink.codec.encoded_nbytes(param.numel()), dtype=np.uint8) if write else None
            batch.append(kernels.CloseTensor(merged[name].to(torch.float32), momentum, param,
                                             self._downlink.residual(name), first_step, out))
        results = kernels.nesterov_int8(batch, lr=lr, mu=mu, block_size=self._downlink.codec.block_size,
                                        threads=self._threads)
        self._payloads = {name: tensor.out for name, tensor in zip(names, batch, strict=True)}
        return results

    def _bounded(self, fragment: int, names: list[str], merged: Mapping[str, torch.Tensor]) -> list[bool]:
        """For each tensor of `names`: whether no new momentum, parameter or change can leave float32's range, bounded
        from the largest values its last fused step wrote and the merged tensor's L2 norm (at least its largest
        value), in float64, against half of float32's largest value (far more than the few roundings need). One read
        of each merged tensor instead of the check's four tensors."""
        lr, mu = self._outer.hyperparameters(fragment)
        held = [self._maxima.get((fragment, name)) for name in names]
        known = [name for name, h in zip(names, held, strict=True) if h is not None]
        norms = dict(zip(known, kernels.l2_norms([merged[n].to(torch.float32) for n in known], self._threads),
                         strict=True))
        bounded = []
        for name, maxima in zip(names, held, strict=True):
            if maxima is None:
                bounded.append(False)
                continue
            momentum_max, param_max, residual_max = maxima
            momentum = abs(mu) * momentum_max + norms[name]
            stepped = param_max + abs(lr) * (norms[name] + abs(mu) * momentum)
            bounded.append(max(momentum, stepped + param_max + residual_max) < SAFE_BOUND)  # False for NaN
        return bounded

    def check(self, fragment: int, merged: Mapping[str, torch.Tensor]) -> tuple[str | None, bool]:
        """(the first tensor whose momentum or parameter would stop being finite, or None; whether every change is
        finite), computed as the step would compute them, writing nothing: by the bound where it holds, else by the
        kernel's check."""
        names = list(self._plan.fragments[fragment])
        unbounded = [name for name, ok in zip(names, self._bounded(fragment, names, merged), strict=True) if not ok]
        changes_finite = True
        for name, result in zip(unbounded, self._batch(fragment, unbounded, merged, write=False), strict=True):
            if result.flags & kernels.STEP_NOT_FINITE:
                return name, False
            changes_finite = changes_finite and not result.flags & kernels.CHANGE_NOT_FINITE
        return None, changes_finite

    def step(self, fragment: int, version: int, merged: Mapping[str, torch.Tensor]) -> FragmentDelta:
        """The step of `fragment` to `version`, in place, and its broadcast. `check` first: every change finite."""
        names = list(self._plan.fragments[fragment])
        for name, result in zip(names, self._batch(fragment, names, merged, write=True), strict=True):
            assert not result.flags, "a change that is not finite: check() first"
            self._maxima[(fragment, name)] = (result.momentum_max, result.param_max, result.residual_max)
        payload = {name: memoryview(self._payloads[name]) for name in names}  # no copy: the arrays are this delta's
        self._payloads = {}
        numels = {name: self._global[fragment][name].numel() for name in names}
        return FragmentDelta(fragment, version, version - 1, self._downlink.codec.name, payload,
                             fragment_checksum(self._global[fragment], names, self._threads),
                             zero=zero_names(self._downlink.codec, payload, numels))

    def forget(self, fragment: int | None = None) -> None:
        """Something else wrote `fragment`'s state (every fragment's: None): its bounds no longer hold."""
        self._maxima = {} if fragment is None else {k: v for k, v in self._maxima.items() if k[0] != fragment}


def make_fused_close(outer: OuterOptimizer, downlink: Downlink, plan: FragmentPlan,
                     global_tensors: list[dict[str, torch.Tensor]], threads: KernelThreads) -> FusedClose | None:
    """The fused close where it applies (the compiled kernels, an int8 downlink), else None: the syncer then takes
    the outer optimizer and the downlink rule."""
    if kernels.compiled is None:
        logger.warning("[syncer] ddiloco._kernels is not built (no C compiler at install?): the merge and the close "
                       "run in torch, with the same bits, several times slower (docs/runtime.md, 'Compiled kernels')")
        return None
    if not isinstance(downlink, DeltaDownlink) or not isinstance(downlink.codec, Int8Codec):
        return None
    return FusedClose(outer, downlink, plan, global_tensors, threads)
