"""A checkpoint's inner-optimizer state, loaded into the optimizer a restarted script builds, parameter group by group.

A script may add a parameter group during the run (`optimizer.add_param_group`, to unfreeze layers at some inner
step), so a checkpoint taken after that holds more groups than the optimizer the restarted script has when its
session starts (the checkpoint is restored there, before the loop adds the group again). `restore_optimizer` loads
the groups the optimizer has now; when the saved first groups match them, the rest wait in `WaitingGroups` for the
optimizer to gain them, checked before each `optimizer.step()` (a step pre-hook: one `len()` per step) and loaded
just before the step that first trains them. A checkpoint taken meanwhile keeps them (`WaitingGroups.append_to`),
so a second restart loses nothing. Groups the optimizer has and the checkpoint lacks (a script that now creates every
group before the session) start afresh. Anything else (another number of parameters in a group) means the model
changed since the run started: ValueError, naming it.

Optimizer state dicts are torch's: `param_groups` (each with `params`, the ids of its parameters, numbered in order
over the groups) and `state` (id -> that parameter's state). Which checkpoint to load, and when, is
`ddiloco.learner_checkpoint`'s business; `optimizer_class` names what the checkpoint records of the optimizer that
wrote it, so that one of another class is not loaded (torch would load AdamW's hyperparameters into an SGD, which
then fails at its first step with `KeyError: 'momentum'`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

OptimizerState = dict[str, Any]
"""`torch.optim.Optimizer.state_dict()`: {"state": {id: ...}, "param_groups": [{"params": [id, ...], ...}, ...]}."""


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as a checkpoint records it: `torch.optim.adamw.AdamW`."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], *, where: str,
                      load: Callable[[OptimizerState], None] | None = None,
                      after_load: Callable[[], None] | None = None) -> WaitingGroups | None:
    """Load `saved` into `optimizer`: the groups it has now, through `load` (default `optimizer.load_state_dict`);
    returns the saved groups it does not have yet, waiting for the script to add them (None when there are none).
    `where` names the checkpoint in errors and logs; `after_load` runs after each load (FSDP2's resharding).
    Raises ValueError when the saved first groups differ from the optimizer's in size."""
    saved_groups = list(saved["param_groups"])
    saved_sizes = [len(group["params"]) for group in saved_groups]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    shared = min(len(sizes), len(saved_sizes))
    if saved_sizes[:shared] != sizes[:shared]:
        raise ValueError(
            f"{where} holds optimizer state for {_parameter_groups(saved_sizes)}, but this script's optimizer has "
            f"{_parameter_groups(sizes)}: the model (or how its optimizer groups the parameters) changed since the "
            "run started. Resume with the model the run started with, or start a new run (a new run directory)")
    changed = _changed_hyperparameters(optimizer.param_groups[:shared], saved_groups[:shared])
    now_ids = {i for group in saved_groups[:shared] for i in group["params"]}
    now = {"state": {i: s for i, s in saved["state"].items() if i in now_ids},
           "param_groups": saved_groups[:shared] + _fresh_groups(optimizer, shared, len(sizes))}
    (load or optimizer.load_state_dict)(now)
    if after_load is not None:
        after_load()
    if changed:
        # torch's load_state_dict takes the saved hyperparameters: a resume with another rate trained on at the old one.
        logger.warning("%s: the optimizer's hyperparameters come back as saved, not as this script set them (%s); to "
                       "change one on a resume, set it in optimizer.param_groups once the session has started", where,
                       "; ".join(changed))
    if len(sizes) > len(saved_sizes):
        logger.info("%s holds %s; this script's optimizer has %d more, which start afresh", where,
                    _parameter_groups(saved_sizes), len(sizes) - len(saved_sizes))
    if len(saved_sizes) <= len(sizes):
        return None
    # A warning: a script that adds the group at one inner step (`== 30`) never adds it again after resuming past it,
    # and its layers would train frozen from here on with nothing said.
    logger.warning("%s holds %s; this script's optimizer has %d so far: the others are restored when the script adds "
                   "them again (optimizer.add_param_group), at its next optimizer.step(). A script that adds a group "
                   "at one inner step must test sync.inner_step >= that step: a learner resumes past it", where,
                   _parameter_groups(saved_sizes), len(sizes))
    later_ids = {i for group in saved_groups[shared:] for i in group["params"]}
    return WaitingGroups(optimizer, saved_groups[shared:], {i: s for i, s in saved["state"].items() if i in later_ids},
                         first=shared, where=where, after_load=after_load)


class WaitingGroups:
    """Saved parameter groups that `optimizer` does not have yet: loaded as it gains them (see the module docstring).
    `groups` are the saved groups, in order, the first of them meant for the optimizer's group number `first`."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], state: dict[Any, Any], *,
                 first: int, where: str, after_load: Callable[[], None] | None = None) -> None:
        self.optimizer = optimizer
        self.groups = groups
        self.state = state
        """The saved state of the waiting groups' parameters, by their saved ids."""
        self.first = first
        self.where = where
        self.after_load = after_load
        self._hook = optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.catch_up())

    def catch_up(self) -> None:
        """Load the waiting groups the optimizer has gained since (the step pre-hook; a checkpoint calls it first)."""
        gained = min(len(self.optimizer.param_groups) - self.first, len(self.groups))
        if gained <= 0:  # (also once every group is restored: the hook stays until `close`, see there)
            return
        current = self.optimizer.state_dict()
        groups = list(current["param_groups"])
        state = dict(current["state"])
        for j, saved in enumerate(self.groups[:gained]):
            live = groups[self.first + j]
            if len(live["params"]) != len(saved["params"]):
                self.groups.clear()  # said once, in the loop: a checkpoint taken as the session fails keeps what is
                self.state.clear()
                raise ValueError(
                    f"{self.where} holds optimizer state for parameter group {self.first + j} of "
                    f"{len(saved['params'])} parameters, but the group this script's optimizer gained "
                    f"(optimizer.add_param_group) has {len(live['params'])}: add the same parameters the run added "
                    "at that point, in the same order (or start a new run)")
            for live_id, saved_id in zip(live["params"], saved["params"], strict=True):
                state.pop(live_id, None)
                if saved_id in self.state:
                    state[live_id] = self.state[saved_id]
            groups[self.first + j] = {**saved, "params": live["params"]}  # the hyperparameters as saved (its lr)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.after_load is not None:
            self.after_load()
        logger.info("%s: parameter group(s) %s restored as the script added them", self.where,
                    ", ".join(str(self.first + j) for j in range(gained)))
        del self.groups[:gained]
        self.first += gained

    @property
    def done(self) -> bool:
        """Whether no group waits any more (every one restored, or refused)."""
        return not self.groups

    def settle(self) -> WaitingGroups | None:
        """Before a checkpoint takes the optimizer's state: the groups the script has added since loaded (`catch_up`;
        the step pre-hook runs only at the next step), then this object while others still wait, else None (its hook
        removed). The caller keeps what it returns and adds the waiting groups to the state with `append_to`."""
        self.catch_up()
        if not self.done:
            return self
        self.close()
        return None

    def close(self) -> None:
        """Remove the step pre-hook. Not from the hook itself: torch iterates over its hooks as it calls them."""
        self._hook.remove()

    def append_to(self, current: Mapping[str, Any]) -> OptimizerState:
        """`current` (the optimizer's state_dict, as a checkpoint takes it) with the groups still waiting after its
        own, numbered on from its parameters, so that the checkpoint keeps them."""
        groups = list(current["param_groups"])
        state = dict(current["state"])
        next_id = 1 + max((i for group in groups for i in group["params"]), default=-1)
        for saved in self.groups:
            ids = list(range(next_id, next_id + len(saved["params"])))
            for new_id, saved_id in zip(ids, saved["params"], strict=True):
                if saved_id in self.state:
                    state[new_id] = self.state[saved_id]
            groups.append({**saved, "params": ids})
            next_id += len(ids)
        return {**current, "state": state, "param_groups": groups}


def _changed_hyperparameters(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[str]:
    """`group N: lr 1e-05 -> 0.002, ...` for each group whose hyperparameters the checkpoint's replace: the numbers,
    flags and tuples both have that differ. Not the rate of a group a schedule drives (it has `initial_lr`): its
    value at the checkpoint is the schedule's, which its own restored state goes on from."""
    changed = []
    for index, (group, old) in enumerate(zip(groups, saved, strict=True)):
        keys = [key for key in group if key != "params" and key in old and not (key == "lr" and "initial_lr" in group)]
        diffs = [f"{key} {group[key]!r} -> {old[key]!r}" for key in keys
                 if _plain(group[key]) and _plain(old[key]) and _as_compared(group[key]) != _as_compared(old[key])]
        if diffs:
            changed.append(f"group {index}: " + ", ".join(diffs))
    return changed


def _plain(value: Any) -> bool:
    return isinstance(value, int | float | bool | str | tuple | list) and not isinstance(value, torch.Tensor)


def _as_compared(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _fresh_groups(optimizer: torch.optim.Optimizer, start: int, stop: int) -> list[dict[str, Any]]:
    """The optimizer's own groups `start`..`stop` as its state dict lists them: its hyperparameters, no state."""
    current = optimizer.state_dict()["param_groups"]
    return [dict(group) for group in current[start:stop]]


def _parameter_groups(sizes: list[int]) -> str:
    """`[6, 2]` as "2 parameter groups of 6 + 2 parameters"."""
    groups = "1 parameter group" if len(sizes) == 1 else f"{len(sizes)} parameter groups"
    return f"{groups} of {' + '.join(map(str, sizes))} parameters"
