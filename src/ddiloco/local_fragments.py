"""A learner's copy of each fragment, held against the global one (`Learner.local`).

Per fragment: the global value the learner last received (the base its next pseudo-gradient is measured from) and
its version; the work trained on it since (inner steps, tokens, and the inner step that work starts after); and its
value when it was last published, whose later steps a new version keeps on top of it (`keep_overlap_work`,
docs/protocol.md). No protocol decision is made here: the learner core (`ddiloco.learner`) decides when to publish and
what a message means; this class keeps the numbers it reads in step with the parameters it writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ddiloco.fragment_access import FragmentAccess
from ddiloco.fragments import FragmentPlan


@dataclass(frozen=True)
class AtPublish:
    """A fragment as it was published: the work after it is not in that update."""

    tensors: dict[str, torch.Tensor]
    steps_since: int
    tokens_since: int
    inner_step: int


class LocalFragments:
    """This learner's fragments against the global ones. See the module docstring."""

    def __init__(self, plan: FragmentPlan, params: Mapping[str, torch.Tensor], access: FragmentAccess) -> None:
        num = plan.num_fragments
        self.plan, self.access = plan, access
        self._devices = {name: param.device for name, param in params.items()}
        self.base: list[dict[str, torch.Tensor]] = [{} for _ in range(num)]
        """Per fragment, the exact global value last received, in float32."""
        self.versions = [-1] * num
        self.steps_since = [0] * num
        self.tokens_since = [0] * num
        self.synced_at = [0] * num
        """Per fragment, the inner step at which it was last published or received: the steps after it are
        this learner's unpublished work on that fragment."""
        self.at_publish: list[AtPublish | None] = [None] * num
        """Per fragment, its local value and counters when it was last published, until a newer version
        arrives (`keep_overlap_work`: the work trained after that point is carried onto it)."""

    def count_step(self, tokens: int) -> None:
        """One inner step of `tokens` tokens trained on every fragment."""
        for p in range(self.plan.num_fragments):
            self.steps_since[p] += 1
            self.tokens_since[p] += tokens

    def unpublished(self, inner_step: int) -> list[int]:
        """Per fragment, inner steps trained since it was last published or received."""
        return [inner_step - at for at in self.synced_at]

    def restart_at(self, inner_step: int) -> None:
        """Count every fragment's work from `inner_step` (a schedule position taken, a checkpoint loaded)."""
        self.synced_at[:] = [inner_step] * self.plan.num_fragments

    def published(self, p: int, current: dict[str, torch.Tensor], inner_step: int, *, keep_value: bool) -> None:
        """Fragment `p` was published at `inner_step` from `current`, a copy of its value that nothing changes in place
        afterwards; `keep_value` holds it until the next version (`keep_overlap_work`)."""
        if keep_value:
            self.at_publish[p] = AtPublish(dict(current), self.steps_since[p], self.tokens_since[p], inner_step)
        self.synced_at[p] = inner_step

    def forget_publish(self, p: int) -> None:
        """Nothing of fragment `p`'s last publish went out (it was withheld): no work is carried from it."""
        self.at_publish[p] = None

    @torch.no_grad()
    def take(self, p: int, tensors: Mapping[str, torch.Tensor], version: int, inner_step: int, *,
             carry: bool, owned: bool = False) -> None:
        """Make `tensors`, version `version` of fragment `p`, its base and its value. With `carry`, and when the
        fragment was published since its last version, the steps trained after that publish are not in the update
        that version merged: they stay on top of the new value, with their counters. Otherwise the value is replaced
        and its work counted from `inner_step`. `owned`: `tensors` are this call's alone (a change just rebuilt),
        so the base keeps each one that is float32 on its parameter's device as it is, without a copy."""
        names = self.plan.fragments[p]
        at_publish, self.at_publish[p] = self.at_publish[p], None
        carry = carry and at_publish is not None
        bases = {name: tensors[name] if owned and tensors[name].dtype == torch.float32
                 and tensors[name].device == self._devices[name]
                 else tensors[name].to(device=self._devices[name], dtype=torch.float32, copy=True) for name in names}
        if carry:
            self.access.carry(p, {name: at_publish.tensors[name] for name in names}, bases)
            self.steps_since[p] -= at_publish.steps_since
            self.tokens_since[p] -= at_publish.tokens_since
            self.synced_at[p] = at_publish.inner_step
        else:
            self.access.write(p, tensors)
            self.steps_since[p] = self.tokens_since[p] = 0
            self.synced_at[p] = inner_step
        self.base[p].update(bases)
        self.versions[p] = version

    @torch.no_grad()
    def reset_non_finite(self, inner_step: int) -> list[int]:
        """Put every fragment whose value is not finite back to its base, its work since then lost (it was NaN);
        returns those fragments."""
        reset = []
        for p, names in enumerate(self.plan.fragments):
            current = self.access.read(p, names)
            if all(bool(torch.isfinite(value).all()) for value in current.values()):
                continue
            self.access.write(p, self.base[p])
            self.steps_since[p] = self.tokens_since[p] = 0
            self.synced_at[p] = inner_step
            self.at_publish[p] = None  # the value it would carry from is gone
            reset.append(p)
        return reset
