"""A model's buffers (BatchNorm's running statistics and batch count, ...): each learner's own, kept across its
restarts, and averaged over the learners wherever one model is evaluated or exported.

Rounds synchronise parameters only (`ddiloco.fragments`). A buffer changes in the forward pass and is read in
evaluation mode, so training does not need the buffers synchronised: each learner keeps its own, as DDP ranks do
with `broadcast_buffers=False`. A model evaluated or exported with the global parameters does need them: with the
buffers it was built with (BatchNorm's mean 0 and variance 1) its evaluation-mode outputs are wrong. So:

- a learner's checkpoint holds its buffers (`LearnerCheckpoint`), and a restarted learner takes them back (before,
  it came back with the buffers its script built);
- at each checkpoint it also writes them to `learners/N/buffers.safetensors` (`write_buffers`), a small file;
- `ddiloco export` and the evaluator (`ddiloco.watch`) load their mean over the learners (`merged_buffers`):
  floating-point buffers averaged value by value (in float64, then in the buffer's own dtype), the others (a batch
  count) taken from the learner with the lowest id. Infinite values that every learner holds alike (a causal mask of
  -inf) are kept as they are; a copy with a NaN, or infinite where the others are not (a statistic that overflowed),
  is left out of the mean.

The buffers are the module's persistent ones (those its `state_dict` holds: a rotary table registered with
`persistent=False` is rebuilt by the module, not kept), under the plain module's names (without a DDP, DataParallel or
torch.compile wrapper's prefix). A buffer registered in two submodules (one tensor, a shared normaliser's statistics)
is kept under each of its names, as its state_dict holds it: a checkpoint and a learner's file hold a copy under each
name, an export their mean under each, and loading copies each into the one tensor in place, so it stays shared (the
copies are equal: they were taken from one tensor).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ddiloco.checkpoint import atomic_write_bytes, learner_files
from ddiloco.fragments import persistent_buffer_names
from ddiloco.learner_group import unwrap

logger = logging.getLogger(__name__)

BUFFERS_FILE = "buffers.safetensors"
"""A learner's latest buffers, in its directory of the run (`learners/N/`)."""


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model`'s state_dict holds, by the plain module's names (live tensors, not copies; a shared buffer
    under each of its names)."""
    plain = unwrap(model)
    kept = set(persistent_buffer_names(plain))
    return {name: buffer for name, buffer in plain.named_buffers(remove_duplicate=False) if name in kept}


def snapshot_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `model`'s persistent buffers on the CPU (a checkpoint's; the training loop goes on changing them), one
    per name: safetensors refuses to save two names of one tensor."""
    return {name: buffer.detach().to("cpu", copy=True) for name, buffer in persistent_buffers(model).items()}


@torch.no_grad()
def load_buffers(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy `buffers` into `model`'s buffers of the same name and shape, in place (a shared buffer stays one tensor);
    returns the names of `model`'s persistent buffers that `buffers` did not provide (kept as they were). A shared
    buffer provided under one of its names only (a file written before they were kept under each) is not missing."""
    own = persistent_buffers(model)
    loaded = set()
    for name, buffer in own.items():
        value = buffers.get(name)
        if value is not None and tuple(value.shape) == tuple(buffer.shape):
            buffer.copy_(value)
            loaded.add(id(buffer))
    return [name for name, buffer in own.items() if id(buffer) not in loaded]


def write_buffers(directory: Path, buffers: Mapping[str, torch.Tensor]) -> None:
    """`directory`/buffers.safetensors, replaced at once (a reader never sees half a file). Nothing without buffers."""
    if not buffers:
        return
    from safetensors.torch import save

    atomic_write_bytes(directory / BUFFERS_FILE, save({n: t.contiguous() for n, t in buffers.items()}), durable=False)


def merged_buffers(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], list[int]]:
    """(the mean of the learners' latest buffers, the learners it took them from, ascending) from the run's
    `learners/N/buffers.safetensors` (module docstring). A file that cannot be read is logged and left out; a buffer
    a learner holds with another shape or dtype than the lowest-id learner's, or not finite where the others are
    (`_mean`), is left out of the mean (a buffer no learner holds usable is left out of the result)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    read: list[tuple[int, dict[str, torch.Tensor]]] = []
    for learner_id, path in learner_files(run_dir, BUFFERS_FILE):
        try:
            read.append((learner_id, load_file(path)))
        except (OSError, SafetensorError) as exc:
            logger.warning("[buffers] %s cannot be read (%s): learner %d's buffers are left out", path, exc,
                           learner_id)
    if not read:
        return {}, []
    merged = {}
    for name, first in read[0][1].items():
        if not first.is_floating_point():
            merged[name] = first
            continue
        mean = _mean([buffers[name] for _, buffers in read
                      if name in buffers and buffers[name].shape == first.shape and buffers[name].dtype == first.dtype])
        if mean is not None:
            merged[name] = mean
    return merged, [learner_id for learner_id, _ in read]


def _mean(copies: list[torch.Tensor]) -> torch.Tensor | None:
    """The learners' copies of one floating-point buffer averaged value by value, or None when none can be. Infinite
    values held alike by every copy without a NaN (a causal mask of -inf: a constant, not a statistic) are kept; the
    finite values around them are averaged. Otherwise only the copies that are finite everywhere count: a NaN, or an
    overflowed statistic, would make the mean NaN or infinite."""
    whole = [value for value in copies if not bool(torch.isnan(value).any())]
    infinite = torch.isinf(whole[0]) if whole else None
    if infinite is None or not all(torch.equal(torch.isinf(value), infinite)
                                   and torch.equal(value[infinite], whole[0][infinite]) for value in whole):
        whole, infinite = [value for value in whole if not bool(torch.isinf(value).any())], None
    if not whole:
        return None
    total = torch.zeros(whole[0].shape, dtype=torch.float64)
    for value in whole:
        total += value.to(torch.float64) if infinite is None else value.to(torch.float64).masked_fill(infinite, 0.0)
    mean = (total / len(whole)).to(whole[0].dtype)
    return mean if infinite is None else torch.where(infinite, whole[0], mean)
