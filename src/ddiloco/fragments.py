"""Cutting a model into fragments, and the schedule on which fragments are synchronised.

A fragment is a set of whole parameter tensors, named by parameter name, so the model itself knows
nothing about fragments. The plan is a pure function of the names and sizes (in values, whatever a
learner's dtypes), so every learner and the syncer compute the same plan independently. Strategies
(Decoupled DiLoCo, arXiv 2604.21428; Streaming DiLoCo, arXiv 2501.18512):

- balanced: largest tensor first, each into the currently lightest fragment by values (flat peak
  bandwidth per round; the paper's choice);
- strided: transformer block i goes to fragment i mod P (Streaming DiLoCo), other tensors bin-packed;
- single: the whole model is one fragment (plain DiLoCo).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.config import DilocoConfig

logger = logging.getLogger(__name__)

BLOCK_PATTERN = r"(?:^|\.)(?:blocks|layers|layer|h)\.(\d+)\."
"""Where `strided` finds a transformer block index in a parameter name: the first `blocks.N.` (ddiloco's TinyGPT,
MPT), `layers.N.` (Llama, Mistral, Qwen, GPT-NeoX, OPT), `layer.N.` (BERT) or `h.N.` (GPT-2, Falcon), so a mixture
of experts' `layers.3.mlp.experts.7.` is block 3. With only `blocks.N.`, a Hugging Face model's `strided` plan would be
`balanced`'s."""


def _check_count(sizes: Mapping[str, int], num_fragments: int) -> None:
    if num_fragments < 1:
        raise ValueError(f"num_fragments={num_fragments} is invalid: expected an integer >= 1")
    if num_fragments > len(sizes):
        raise ValueError(f"num_fragments={num_fragments} exceeds the {len(sizes)} tensors of the model: "
                         f"every fragment needs at least one whole tensor (use --num-fragments {len(sizes)} or "
                         "fewer; DilocoConfig.num_fragments in process)")


def _pack(sizes: Mapping[str, int], bins: list[list[str]], loads: list[int], names: Sequence[str]) -> None:
    # Largest first, ties broken by name, so the plan never depends on dict order.
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        lightest = min(range(len(bins)), key=lambda i: (loads[i], i))
        bins[lightest].append(name)
        loads[lightest] += sizes[name]


def _in_model_order(sizes: Mapping[str, int], bins: list[list[str]]) -> list[list[str]]:
    order = {name: i for i, name in enumerate(sizes)}
    return [sorted(names, key=order.__getitem__) for names in bins]


def balanced(sizes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Bin-pack whole tensors (name -> size) into `num_fragments` lists of nearly equal size."""
    _check_count(sizes, num_fragments)
    bins: list[list[str]] = [[] for _ in range(num_fragments)]
    _pack(sizes, bins, [0] * num_fragments, list(sizes))
    return _in_model_order(sizes, bins)


def strided(sizes: Mapping[str, int], num_fragments: int, *,
            block_pattern: str = BLOCK_PATTERN) -> list[list[str]]:
    """Deal transformer blocks round-robin by block index; bin-pack the remaining tensors."""
    _check_count(sizes, num_fragments)
    bins: list[list[str]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    rest = []
    for name, size in sizes.items():
        match = re.search(block_pattern, name)
        if match is None:
            rest.append(name)
            continue
        index = int(match.group(1)) % num_fragments
        bins[index].append(name)
        loads[index] += size
    if len(rest) == len(sizes):
        logger.warning("fragment strategy strided: no parameter name holds a block index (%s), so the fragments are "
                       "balanced's: name the blocks' ModuleList blocks, layers or h, or use --fragment-strategy "
                       "balanced", BLOCK_PATTERN)
    _pack(sizes, bins, loads, rest)
    if any(not names for names in bins):
        raise ValueError(f"strided fragmentation left a fragment empty with num_fragments={num_fragments}: "
                         "use fewer fragments or the balanced strategy")
    return _in_model_order(sizes, bins)


def embedding_names(model: nn.Module, pattern: str = "") -> frozenset[str]:
    """The model's embedding tables: parameters of `nn.Embedding` modules (any name: `wte`, `embed_tokens`,
    `token_embedding`, ...), or, with a non-empty `pattern`, the parameter names it matches (re.search),
    for embeddings that are not `nn.Embedding` modules. Tied weights count once, under the name
    `named_parameters()` gives them."""
    names = dict(model.named_parameters())
    if pattern:
        return frozenset(n for n in names if re.search(pattern, n))
    ids = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    return frozenset(name for name, param in names.items() if id(param) in ids)


def persistent_buffer_names(module: nn.Module) -> list[str]:
    """The names of the buffers `module`'s state_dict holds (BatchNorm's running statistics; not a buffer registered
    with `persistent=False`), which rounds do not synchronise (`ddiloco.model_buffers`). `module` is the plain one,
    not a DDP, DataParallel or torch.compile wrapper. A buffer registered in two submodules (one tensor) is named
    under each of its names, as the state_dict holds it: `named_buffers()` alone gives the first name only, and an
    export lacking the other failed the documented strict `load_state_dict`."""
    non_persistent = {f"{prefix}.{name}" if prefix else name
                      for prefix, sub in module.named_modules(remove_duplicate=False)
                      for name in sub._non_persistent_buffers_set}
    return [name for name, _ in module.named_buffers(remove_duplicate=False) if name not in non_persistent]


def due_step(round_index: int, sync_every: int, num_fragments: int) -> int:
    """The inner step at which round `round_index` (syncing fragment round_index mod P) is due.

    Spreads the P rounds of each period evenly over its H inner steps, so every fragment is
    synchronised exactly once per H inner steps: (r div P) * H + floor(((r mod P) + 1) * H / P).
    """
    period, slot = divmod(round_index, num_fragments)
    return period * sync_every + ((slot + 1) * sync_every) // num_fragments


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameter belongs to which fragment, and which parameters are embeddings."""

    fragments: tuple[tuple[str, ...], ...]
    embeddings: frozenset[str]

    @classmethod
    def for_tensors(cls, named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
                    config: DilocoConfig, *, embeddings: Iterable[str] = ()) -> FragmentPlan:
        """`embeddings`: the parameters merged by plain weighted mean (see `embedding_names`); with
        `config.embedding_pattern` set, the names it matches instead."""
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        # Sized in values, not bytes: the syncer holds every tensor in float32 whatever the learner's dtype, and a
        # learner with some layers in bf16 must cut its model where the syncer does (in bytes their plans differed).
        sizes = {name: t.numel() for name, t in items}
        if config.fragment_strategy == "strided":
            bins = strided(sizes, config.num_fragments)
        else:
            bins = balanced(sizes, config.num_fragments)
        if config.embedding_pattern:
            chosen = frozenset(n for n in sizes if re.search(config.embedding_pattern, n))
        else:
            chosen = frozenset(embeddings)
            unknown = sorted(chosen - set(sizes))
            if unknown:
                raise ValueError(f"embedding {unknown[0]!r} is not a parameter of the model")
        return cls(tuple(tuple(names) for names in bins), chosen)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_of(self, name: str) -> int:
        for index, names in enumerate(self.fragments):
            if name in names:
                return index
        raise KeyError(f"parameter {name!r} is in no fragment")
