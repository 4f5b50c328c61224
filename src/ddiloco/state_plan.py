"""Whether a syncer state fits the syncer that loads it: the fragment plan it was written with.

The outer momentum is kept by position within each fragment (torch's optimizer state), so a state loaded into a syncer
that cuts the model into fragments another way puts each momentum buffer on another tensor, one of the same shape
without a word. A state records its plan (each fragment's tensor names, since 2026-12-06: `plan_difference` compares
them); an older one is checked by what is on disk: the tensors each fragment's round files name
(`rounds_plan_difference`) and its momentum's shapes. A difference is refused with `plan_refusal`'s error. Found when
a run started by one ddiloco version was resumed by another whose plan for a Hugging Face model's `layers.N` names
differed: 70 updates rejected as non-finite, the run still "completed".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ddiloco.fragments import FragmentPlan
from ddiloco.round_log import RoundLog


def plan_refusal(difference: str) -> ValueError:
    """The error of a syncer state written with another fragment plan than this syncer's (`difference` says how)."""
    return ValueError(f"the syncer's state was written with another fragment plan ({difference}): a ddiloco version "
                      "that cuts this model into fragments differently wrote it; resume the run with the version that "
                      "started it")


def plan_difference(state: Mapping, plan: FragmentPlan, fragments: Sequence[Mapping[str, torch.Tensor]]) -> str | None:
    """How the plan `state` was written with differs from `plan`, or None. `fragments`: the loading syncer's global
    tensors by fragment, in its plan's order. A state without its plan (before 2026-12-06) is checked by its
    momentum's shapes here (and by its round files in `rounds_plan_difference`, which needs the run directory)."""
    saved = state.get("fragments")
    if saved is not None:
        for p, (theirs, ours) in enumerate(zip(saved, plan.fragments, strict=False)):
            if list(theirs) != list(ours):
                return f"fragment {p} held {list(theirs)}, this syncer's plan puts {list(ours)} in it"
        if len(saved) != plan.num_fragments:
            return f"it has {len(saved)} fragments, this syncer's plan {plan.num_fragments}"
        return None
    for p, (fragment, outer) in enumerate(zip(fragments, state["outer"], strict=False)):
        buffers = outer.get("state", {})
        for position, (name, tensor) in enumerate(fragment.items()):
            momentum = buffers.get(position, {}).get("momentum_buffer")
            if momentum is not None and tuple(momentum.shape) != tuple(tensor.shape):
                return (f"fragment {p}'s momentum at position {position} has shape {tuple(momentum.shape)}, "
                        f"where this syncer's plan puts {name!r} {tuple(tensor.shape)}")
    return None


def rounds_plan_difference(log: RoundLog, plan: FragmentPlan) -> str | None:
    """How the plan the run's round files were written with differs from `plan`, or None. Each round's file holds its
    fragment's merged tensors by name: the newest file of each fragment on disk says which tensors that fragment held
    (compared as sets: a file orders them its own way, so a plan that differed only in one fragment's order is not
    seen). For a state without its plan, whose momentum shapes line up in a model of same-shape blocks."""
    seen: set[int] = set()
    for line in reversed(log.lines()):
        p, index = int(line["fragment"]), int(line["round"])
        if p in seen or not 0 <= p < plan.num_fragments or not log.tensors_path(index).exists():
            continue
        seen.add(p)
        try:
            with safe_open(str(log.tensors_path(index)), framework="pt") as tensors:
                names = sorted(tensors.keys())
        except (OSError, SafetensorError):
            continue  # a damaged file: the replay names it
        if names != sorted(plan.fragments[p]):
            return (f"round {index}'s file holds fragment {p} as {names}, this syncer's plan puts "
                    f"{sorted(plan.fragments[p])} in it")
        if len(seen) == plan.num_fragments:
            break
    return None
