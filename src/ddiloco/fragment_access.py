"""How the learner core reads and writes a fragment's parameters, wherever they live.

The core (`ddiloco.learner.Learner`) never touches a parameter directly: a publish reads the fragment
(a float32 copy, which the pseudo-gradient is then taken from, on another thread if need be), and a
fragment from the syncer is written in place. `LocalParameters` serves a learner whose process holds every
parameter; `ddiloco.learner_group.LearnerGroup` serves one spread over torch.distributed ranks (replicas or
shards), gathering to and sending from the rank that talks to the syncer.
"""

from __future__ import annotations

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

    def forget_non_finite_state(self) -> int:
        return 0  # no other ranks
