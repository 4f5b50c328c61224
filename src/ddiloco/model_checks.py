"""What a model and its optimizer must be for a run, checked once as `ddiloco.session(...)` starts (and the model as
`ddiloco.watch(...)` starts), so that what the run cannot sync, checkpoint or export is refused there in one line naming
it, not found rounds later: every parameter materialized, of a dtype the float32 global model holds; every persistent
buffer of a dtype a checkpoint keeps; no two parameters sharing memory; an optimizer that trains the model's parameters
and nothing else.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ddiloco.model_buffers import persistent_buffers
from ddiloco.state_tree import TORCH_DTYPES

logger = logging.getLogger(__name__)


def check_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every check of this module on the plain `model` (no wrapper) and the `optimizer` that trains it."""
    check_materialized(model, caller="ddiloco.session(...)")
    _parameter_dtypes(model)
    _buffer_dtypes(model)
    _no_overlapping_parameters(model)
    check_optimizer_of_model(model, optimizer)


def check_materialized(model: nn.Module, *, caller: str) -> None:
    """ValueError, saying what to do before `caller` ("ddiloco.session(...)", "ddiloco.watch(...)"), when a parameter
    of `model` has no shape yet (a lazy module before its first forward pass) or no values (the meta device): the run
    needs every shape to cut fragments and every value to sync. Without it a lazy model failed deep inside torch
    ("Attempted to use an uninitialized parameter in <method 'numel' ...>")."""
    lazy = [name for name, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(f"parameter {lazy[0]!r} is not initialized yet (a lazy module; {len(lazy)} in all): run "
                         f"one forward pass before {caller}, so that the run knows every shape")
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"parameter {meta[0]!r} is on the meta device, without values ({len(meta)} in all): "
                         f"materialize the model before {caller} (model.to_empty(device=...), then initialize its "
                         "parameters)")


def _parameter_dtypes(model: nn.Module) -> None:
    """The run keeps every parameter in float32 (the syncer's global state, joins, rounds): refuse those float32
    cannot hold, and say once that float64 ones are synchronised at float32 precision. Without this a complex
    parameter lost its imaginary part at every sync and an int64 one above 2^24 came back rounded, silently."""
    params = list(model.named_parameters())
    unfit = [(name, p.dtype) for name, p in params if p.is_complex() or not p.is_floating_point()]
    if unfit:
        name, dtype = unfit[0]
        count = f"{len(unfit)} parameter{'s' if len(unfit) > 1 else ''} of a dtype float32 cannot hold"
        names = ": " + ", ".join(repr(n) for n, _ in unfit) if len(unfit) > 1 else ""
        what = _dtype_name(dtype)
        if dtype.is_complex:
            fix = ("ddiloco synchronises parameters in float32, which would drop the imaginary part at every sync. "
                   "Keep it as a real parameter of pairs (nn.Parameter(torch.view_as_real(w)), and "
                   "torch.view_as_complex(self.w) where the module uses it)")
        else:
            fix = ("ddiloco synchronises floating-point parameters only, in float32 (an integer above 2^24 would come "
                   "back rounded). A value that is not trained belongs in a buffer: "
                   f"module.register_buffer({name.rsplit('.', 1)[-1]!r}, tensor) (each learner keeps its own, and its "
                   "checkpoint keeps it)")
        raise TypeError(f"parameter {name!r} is {what} ({count}{names}): {fix}")
    wide = [name for name, p in params if p.dtype == torch.float64]
    if wide:
        logger.warning("parameter %r is float64 (%d in all%s): it is synchronised in float32 (the syncer's global "
                       "state, joins and rounds), so every sync rounds it to float32 precision (about 7 digits), "
                       "though the learner trains it in float64 between syncs. Use float32 parameters to say so, or "
                       "keep a value that needs float64 in a buffer", wide[0], len(wide),
                       ": " + ", ".join(map(repr, wide)) if len(wide) > 1 else "")


def _buffer_dtypes(model: nn.Module) -> None:
    """A learner's checkpoint keeps the model's persistent buffers (`ddiloco.model_buffers`) in safetensors, which does
    not hold every dtype (`state_tree.TORCH_DTYPES`): refuse such a buffer here. Without this a complex128 buffer
    trained to the end of the budget, failed at the closing checkpoint, and failed again at every restart."""
    unfit = [(name, buffer.dtype) for name, buffer in persistent_buffers(model).items()
             if buffer.dtype not in TORCH_DTYPES]
    if unfit:
        name, dtype = unfit[0]
        more = f" ({len(unfit)} in all: {', '.join(repr(n) for n, _ in unfit)})" if len(unfit) > 1 else ""
        raise TypeError(f"buffer {name!r} is {_dtype_name(dtype)}{more}, which a learner's checkpoint cannot keep (it "
                        "keeps the model's persistent buffers in safetensors, which does not store that dtype). Keep "
                        "it as a real buffer of pairs (torch.view_as_real(t)) or in complex64, or register it with "
                        "persistent=False if the module rebuilds it itself")


def _no_overlapping_parameters(model: nn.Module) -> None:
    """ValueError when two parameters share memory (one a view of the other): each is synchronised on its own, so the
    global model would hold two values for the same numbers, and a learner writing one fragment would change another.
    Tied weights (one Parameter under two names) are one parameter, and parameters cut from one flat buffer without
    overlapping (interleaved ones included) are fine."""
    spans: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():  # each Parameter once, under its first name
        if p.numel() == 0 or type(p.data) is not torch.Tensor:
            continue  # a tensor subclass (FSDP2's DTensor shards) has no storage of its own to compare
        start = p.storage_offset() * p.element_size()
        end = start + (1 + sum((n - 1) * abs(s) for n, s in zip(p.shape, p.stride(), strict=True))) * p.element_size()
        spans.setdefault(p.untyped_storage().data_ptr(), []).append((start, end, name, p))
    for held in spans.values():
        held.sort(key=lambda span: (span[0], -span[1]))  # the wider of two that start together first
        for i, (_, end, name, p) in enumerate(held):
            for start, _, other_name, other in held[i + 1:]:
                if start >= end:
                    break  # sorted by start: no later one reaches into this one
                if _share_elements(p, other):
                    raise ValueError(
                        f"parameters {name!r} and {other_name!r} share memory (one is a view of the other): ddiloco "
                        "synchronises each parameter on its own, so the run would hold two values for the same "
                        "numbers. Make one of them a view taken in forward() (e.g. self.w[:2]) instead of a second "
                        "nn.Parameter, or give it its own storage (.clone())")


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage whose byte ranges overlap hold a byte in common (interleaved views do not)."""
    def byte_offsets(t: torch.Tensor) -> torch.Tensor:
        offsets = torch.full((), t.storage_offset() * t.element_size(), dtype=torch.int64)
        for size, stride in zip(t.shape, t.stride(), strict=True):
            offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride * t.element_size()
        return (offsets.reshape(-1, 1) + torch.arange(t.element_size(), dtype=torch.int64)).reshape(-1)

    return bool(torch.isin(byte_offsets(a), byte_offsets(b)).any())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_optimizer_of_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless `optimizer` trains the model's parameters and nothing else. A tensor outside the model (learned
    loss weights kept beside it) is neither synced, checkpointed nor exported: every learner trained its own, and a
    restart set it back to its initial value while its optimizer state resumed from the checkpoint."""
    owned = {id(p) for p in model.parameters()}
    held = [(index, p) for index, group in enumerate(optimizer.param_groups) for p in group["params"]]
    if not any(id(p) in owned for _, p in held):
        raise ValueError("the optimizer holds none of the model's parameters: pass the optimizer that trains this "
                         "model")
    outside = [(index, tuple(p.shape)) for index, p in held if id(p) not in owned]
    if outside:
        shown = "; ".join(f"param group {index}, shape {shape}" for index, shape in outside[:3])
        more = f"; and {len(outside) - 3} more" if len(outside) > 3 else ""
        one = len(outside) == 1
        noun = "1 tensor that is no parameter" if one else f"{len(outside)} tensors that are no parameters"
        it, value = ("it", "value") if one else ("them", "values")
        raise ValueError(f"the optimizer trains {noun} of the model ({shown}{more}): the run syncs, checkpoints and "
                         f"exports only the model's parameters, so every learner would train {it} apart and a restart "
                         f"would set {it} back to {'its' if one else 'their'} initial {value}; make {it} part of the "
                         "model (an nn.Parameter attribute of the model or of one of its modules)")
