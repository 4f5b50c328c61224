"""Observers that look inside Decoupled DiLoCo rounds during a harness run, for the experiments.

Owns `MergeNormProbe`: for every committed round with at least two participants, the ratio of the
merged pseudo-gradient's norm to the token-weighted mean of the participants' norms (per fragment,
all tensors of the fragment as one vector). Radial-directional averaging (RDA, Decoupled DiLoCo,
arXiv 2604.21428) is built to keep that ratio at 1 whatever M; a plain weighted mean of nearly
orthogonal vectors shrinks it towards 1 / sqrt(M). The probe decodes the updates with the run's own
codec, so it sees exactly what the syncer merged.
"""

from __future__ import annotations

import math

import torch

from ddiloco.compression import get_codec
from ddiloco.messages import RoundRecord, Update


class MergeNormProbe:
    """Collects merged-norm / mean-norm ratios of multi-learner rounds (see the module docstring)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self._shapes = shapes
        self._norms: dict[tuple[int, int], float] = {}
        self.ratios: list[float] = []

    def on_accepted(self, update: Update) -> None:
        codec = get_codec(update.codec)
        squares = sum(float(codec.decode(data, self._shapes[name]).square().sum())
                      for name, data in update.payload.items())
        self._norms[(update.learner_id, update.fragment)] = math.sqrt(squares)

    def on_commit(self, record: RoundRecord) -> None:
        norms = [self._norms.pop((p.learner_id, record.fragment)) for p in record.participants]
        weights = [p.weight for p in record.participants]
        if len(norms) < 2 or sum(weights) == 0:
            return
        mean_norm = sum(w * n for w, n in zip(weights, norms, strict=True)) / sum(weights)
        merged_norm = math.sqrt(sum(float(t.square().sum()) for t in record.merged.values()))
        if mean_norm > 0:
            self.ratios.append(merged_norm / mean_norm)

    @property
    def mean_ratio(self) -> float:
        return sum(self.ratios) / len(self.ratios) if self.ratios else math.nan


def parameter_shapes(params: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in params.items()}
