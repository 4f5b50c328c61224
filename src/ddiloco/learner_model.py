"""The user's model as a learner declares it to the syncer, and the checks that it is still that model.

A learner describes its model once, when it starts (`DeclaredModel`): the tensors it synchronises (`ModelSpec`, in
float32 whatever it trains in), which of them are embeddings, the tied weights known under two names, and the
persistent buffers. Everything the syncer holds is measured against that description, so a model that changes after
the start must be caught before its values reach the wire:

- `check_objects()`: a parameter replaced, added or removed (identities only, no tensor work; every inner step).
- `check_shapes(names)`: a tensor swapped into the same parameter object with another shape (at each publish and
  each receive of the fragment that holds it).
- `check_range(tensors)`: a float16 parameter that cannot hold its global value (at each receive).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ddiloco.fragment_access import ParameterObjects
from ddiloco.fragments import embedding_names, persistent_buffer_names
from ddiloco.messages import ModelSpec


class ParameterShapeChanged(RuntimeError):
    """A parameter's shape changed in place after the learner started (not a ValueError: `LearnerRules.receive` takes
    those for a malformed message and goes on; this is the learner's own model, and it cannot go on)."""


class DeclaredModel:
    """What a learner's join says about `model`, taken when the learner starts. See the module docstring."""

    def __init__(self, model: nn.Module, embedding_pattern: str) -> None:
        self.params = dict(model.named_parameters())
        self._objects = ParameterObjects(model)
        # Declared in float32 whatever the learner trains in (bf16 parameters): the global model is float32, and
        # so is everything on the wire; a fragment is loaded into the parameter's own dtype (mixed precision).
        self.spec = ModelSpec.from_named_tensors(self.params.items()).in_dtype("float32")
        self._shapes = {spec.name: spec.shape for spec in self.spec.tensors}
        self.embeddings = embedding_names(model, embedding_pattern)
        canonical = {id(p): name for name, p in self.params.items()}
        every = model.named_parameters(remove_duplicate=False)
        self.aliases = tuple(sorted((alias, canonical[id(p)]) for alias, p in every if canonical[id(p)] != alias))
        """Tied weights: (state_dict key, parameter name) pairs for parameters known under two names."""
        self.buffers = tuple(sorted(persistent_buffer_names(model)))
        """The names of the model's persistent buffers, sent with the join (an --init file may hold them)."""

    def check_objects(self) -> None:
        """Raise ValueError naming each parameter replaced, added or removed since the learner started
        (`ParameterObjects.check`)."""
        self._objects.check()

    def check_shapes(self, names: tuple[str, ...]) -> None:
        """ParameterShapeChanged naming the first of `names` whose shape is not the one the learner started with (the
        identity check, `check_objects`, cannot see a tensor swapped into the same parameter object)."""
        for name in names:
            now, declared = tuple(self.params[name].shape), self._shapes[name]
            if now != declared:
                raise ParameterShapeChanged(
                    f"parameter {name!r} is {list(now)} now, {list(declared)} when ddiloco.session(...) started: "
                    "its shape changed in place (transformers' model.resize_token_embeddings(...) does so, keeping "
                    "the parameter object). ddiloco synchronises the parameters as they were when the session "
                    "started: resize the model before ddiloco.session(...)")

    def check_range(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """TypeError when a float16 parameter cannot hold its global value (|x| > 65504: infinite once loaded), as for
        any parameter of a dtype the run cannot sync (`ddiloco.session`): the learner withheld every update of that
        fragment as non-finite, recovered by loading the same value, and so on for good. Not a ValueError, which
        `LearnerRules.receive` takes for a malformed message and ignores: the fault is this learner's dtype."""
        for name, value in tensors.items():
            dtype = self.params[name].dtype
            if dtype != torch.float16 or value.numel() == 0:
                continue
            largest = float(value.abs().max())
            if largest > torch.finfo(dtype).max:
                raise TypeError(f"parameter {name!r} is float16, and its global value (|x| up to {largest:.6g}) is out "
                                 f"of float16's range (65504): loaded, it would be infinite. Train it in bfloat16 "
                                 "or float32 (model.to(torch.bfloat16)), which hold the global model's range")
