"""How the learner core reads and writes a fragment's parameters, wherever they live.

The core (`ddiloco.learner.Learner`) never touches a parameter directly: a publish reads the fragment
(a float32 copy, which the pseudo-gradient is then taken from, on another thread if need be), and a
fragment from the syncer is written in place. `LocalParameters` serves a learner whose process holds every
parameter; `ddiloco.learner_group.LearnerGroup` serves one spread over torch.distributed ranks (replicas or
shards), gathering to and sending from the rank that talks to the syncer.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Protocol

import torch


class FragmentAccess(Protocol):
    """How the core reads and writes one fragment's parameters. `LocalParameters` when this process holds
    them all; `ddiloco.learner_group.LearnerGroup` when the learner spans torch.distributed ranks (the
    values are then gathered to, and sent from, the rank that talks to the syncer)."""

    def read(self, fragment: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """A float32 copy of each parameter's full value, owned by the caller (training goes on meanwhile)."""
        ...

    def write(self, fragment: int, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite each parameter in place with its full value."""
        ...

    def carry(self, fragment: int, at_publish: Mapping[str, torch.Tensor], bases: Mapping[str, torch.Tensor]) -> None:
        """Set each parameter to (its value - `at_publish`) + `bases`, in float32 (`keep_overlap_work`)."""
        ...

    def forget_non_finite_state(self) -> int:
        """The other ranks' inner optimizers drop the state that is not finite (`Learner.recover`); this process's own
        is the learner core's to clear. Returns how many parameter states this call dropped here (0)."""
        ...


class LocalParameters:
    """Every parameter in this process: a read is a float32 copy on the parameter's device, a write an in-place
    copy (so the inner optimizer's state, which refers to the parameter objects, survives)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = params

    @torch.no_grad()
    def read(self, fragment: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {name: self.params[name].detach().to(torch.float32, copy=True) for name in names}

    @torch.no_grad()
    def write(self, fragment: int, values: Mapping[str, torch.Tensor]) -> None:
        for name, value in values.items():
            self.params[name].copy_(value)

    @torch.no_grad()
    def carry(self, fragment: int, at_publish: Mapping[str, torch.Tensor], bases: Mapping[str, torch.Tensor]) -> None:
        """In the float32 parameter itself where it is one (two passes, nothing allocated: a copy the size of a
        fragment cost its learner more in page faults than the arithmetic); through a float32 copy otherwise."""
        in_place = {name for name in bases if self.params[name].dtype == torch.float32
                    and self.params[name].device == bases[name].device == at_publish[name].device}
        for name in in_place:
            self.params[name].sub_(at_publish[name]).add_(bases[name])
        carry_by_copy(self, fragment, {name: at_publish[name] for name in bases if name not in in_place}, bases)

    def forget_non_finite_state(self) -> int:
        return 0  # no other ranks


@torch.no_grad()
def carry_by_copy(access: FragmentAccess, fragment: int, at_publish: Mapping[str, torch.Tensor],
                  bases: Mapping[str, torch.Tensor]) -> None:
    """`FragmentAccess.carry` for the parameters `at_publish` names, through a float32 copy read and written back:
    (value - at publish) + base, the bits of base + (value - at publish)."""
    if not at_publish:
        return
    values = access.read(fragment, tuple(at_publish))
    for name, value in values.items():
        value.sub_(at_publish[name].to(torch.float32)).add_(bases[name])
    access.write(fragment, values)


class ParameterObjects:
    """The parameter objects a model held when its learner started: a run syncs those, so one replaced, added or
    removed since would train on this learner alone and never be synchronised (nor exported). `check` tells, at each
    inner step (`Learner.after_inner_step`), from identities alone: each module's own registry of parameters and
    submodules against what it held at the start, about a fifth of walking `named_parameters()` (25 against 113
    microseconds a step for a 12-layer transformer's 147 parameters in 124 modules, measured on this machine)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._named = dict(model.named_parameters())
        # FSDP2 swaps a module's sharded parameters for unsharded ones around forward and backward (and leaves them so
        # when resharding after backward is off): the identities change by design, so they are not checked there.
        self.checked = not any(hasattr(p, "to_local") for p in self._named.values())
        self._structure = self._snapshot()

    def _snapshot(self) -> tuple[list[torch.nn.Module], list]:
        modules = list(self._model.modules())
        return modules, self._held(modules)

    @staticmethod
    def _held(modules: list[torch.nn.Module]) -> list:
        """What `modules` hold now, in order: each one's parameters, then its submodules (None for an unset one)."""
        return [value for module in modules for registry in (module._parameters, module._modules)
                for value in registry.values()]

    def _unchanged(self) -> bool:
        modules, then = self._structure
        now = self._held(modules)
        return len(now) == len(then) and all(map(operator.is_, now, then))

    def check(self) -> None:
        """Raise ValueError naming each parameter replaced, added or removed since the start; freezing or unfreezing
        one changes nothing here. A module swapped for one that holds the same parameters (an activation, say) is no
        change: the registries are read again and the check goes on from them."""
        if not self.checked or self._unchanged():
            return
        current = dict(self._model.named_parameters())
        changes = {"replaced": [n for n, p in self._named.items() if n in current and current[n] is not p],
                   "added": [n for n in current if n not in self._named],
                   "removed": [n for n in self._named if n not in current]}
        if not any(changes.values()):
            self._structure = self._snapshot()
            return
        named = "; ".join(f"{', '.join(map(repr, names))} ({what})" for what, names in changes.items() if names)
        raise ValueError(f"the model's parameters changed after ddiloco.session(...) started: {named}. ddiloco "
                         "synchronises the parameters the model had when the session started, so a new one would "
                         "train on this learner alone and never be synchronised or exported. Build the whole model "
                         "(every module, every parameter) before ddiloco.session(...); to train a part later, freeze "
                         "it (requires_grad_(False)) and unfreeze it then (optimizer.add_param_group), and copy new "
                         "values into a parameter in place (param.data.copy_(...)) rather than assigning a new one")
