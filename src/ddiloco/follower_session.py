"""What `ddiloco.session` returns on the ranks of a learner other than rank 0: the same loop surface as a
`Session` (`done`, `inner_step`, `step()`, the `with` block), with no syncer, transport, ledger or status
file of its own. Each call serves rank 0's commands until rank 0 ends it (`ddiloco.learner_group`): a
fragment from the syncer arrives by broadcast (or, sharded, by scatter), a publish gathers shards, a
checkpoint collects this rank's `state=` objects. So the user's loop runs unchanged on every rank, and every
rank leaves it after the same inner step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddiloco.config import DEFAULT_MAX_TOKENS_PER_STEP, DilocoConfig
from ddiloco.fragments import FragmentPlan, embedding_names
from ddiloco.learner_checkpoint import stateful_objects
from ddiloco.learner_group import LearnerGroup, unwrap
from ddiloco.model_buffers import load_buffers, snapshot_buffers
from ddiloco.non_finite import forget_non_finite_state, reset_non_finite_statistics
from ddiloco.optimizer_restore import WaitingGroups, restore_optimizer
from ddiloco.session_lifecycle import SessionLifecycle
from ddiloco.sharded_state import local_tensors, reshard_optimizer
from ddiloco.step_arguments import check_tokens_bound, user_metrics

logger = logging.getLogger(__name__)


class FollowerSession(SessionLifecycle):
    """Rank r > 0 of learner `learner_id`. Use `ddiloco.session()`, which makes it on those ranks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, diloco: DilocoConfig, learner_id: int,
                 group: LearnerGroup, inner_steps: int, state: Mapping[str, Any] | None = None,
                 handle_sigterm: bool = True, max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP) -> None:
        if group.leader:
            raise ValueError("rank 0 of a learner runs a Session, not a FollowerSession")
        super().__init__(handle_sigterm=handle_sigterm)
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.state = stateful_objects(state)
        self._learner_id = learner_id
        self.inner_steps = inner_steps
        """The run's inner-step budget, as rank 0's `Session.inner_steps`."""
        self.max_tokens_per_step = max_tokens_per_step
        """The run's bound on one inner step's tokens (`QuorumConfig.max_tokens_per_step`): this rank's count alone
        must keep to it (rank 0 checks the sum)."""
        plain = unwrap(model)
        params = dict(plain.named_parameters())
        # The same plan as rank 0's Learner: the fragments are named by index in the leader's commands.
        embeddings = embedding_names(plain, diloco.embedding_pattern)
        group.fragments = FragmentPlan.for_tensors(params, diloco, embeddings=embeddings).fragments
        self._inner_step = 0
        self._done = False
        self._waiting_groups: WaitingGroups | None = None
        """Optimizer parameter groups of the restored checkpoint that the script has not added yet."""

    @property
    def learner_id(self) -> int:
        return self._learner_id

    @property
    def inner_step(self) -> int:
        """The learner's inner step, as rank 0 last said."""
        return self._inner_step

    @property
    def done(self) -> bool:
        return self._done

    @property
    def ready(self) -> bool:
        return True

    def request_stop(self) -> None:
        """Rank 0 hears of it at the next `step()` (summed over the ranks), and the whole learner stops."""
        self.group.stop_requested = True

    def _open(self) -> None:
        self._serve()

    def log(self, metrics: Mapping[str, Any], *, step: int | None = None) -> None:
        """As `Session.log`, checked the same way so a loop fails alike on every rank; rank 0's values are the
        learner's, and this rank's are not written."""
        user_metrics(f"learner/{self.learner_id}", metrics)

    def step(self, tokens: int, *, loss: float | None = None) -> None:
        """This rank's inner step is done: `tokens` are its own batch's (rank 0 sums every rank's)."""
        tokens = self._check_step(tokens)
        check_tokens_bound(tokens, self.max_tokens_per_step)
        self._serve(tokens=tokens, stepping=True)

    def close(self, *, failed: bool = False) -> None:
        if self._closed or not self._entered:
            return
        self._closed = True
        try:
            if not failed:
                self.group.meet_at_close(self._inner_step)  # bounded: rank 0 may still be in its loop
                self._serve()
        finally:
            self._restore_sigterm()

    def _serve(self, *, tokens: int = 0, stepping: bool = False) -> None:
        self._inner_step, self._done, exit_status = self.group.serve(
            tokens=tokens, stepping=stepping, save=self._own_state, restore=self._restore, forget=self._forget)
        if exit_status:
            # Rank 0 was refused or found no syncer: this rank ends with the same status.
            raise SystemExit(exit_status)

    def _reshard(self) -> None:
        if self.group.sharded:
            reshard_optimizer(self.optimizer)

    def _forget(self) -> None:
        """Rank 0 found its model not finite (`Learner.recover`): this rank's optimizer and statistics start again
        where they are not finite too (its parameters come back from rank 0 with the fragments)."""
        forget_non_finite_state(self.optimizer)
        reset_non_finite_statistics(unwrap(self.model))

    def _own_state(self) -> dict[str, Any]:
        state = {"state": {name: obj.state_dict() for name, obj in self.state.items()}, "optimizer": None,
                 "buffers": snapshot_buffers(self.model)}
        waiting = self._waiting_groups = self._waiting_groups.settle() if self._waiting_groups is not None else None
        if self.group.sharded:
            # This rank's shard of the optimizer state; groups the script has not added again stay in it.
            optimizer = self.optimizer.state_dict()
            state["optimizer"] = local_tensors(waiting.append_to(optimizer) if waiting is not None else optimizer)
        return state

    def _restore(self, entry: Mapping[str, Any]) -> None:
        if entry.get("optimizer") is not None:
            # Rank 0 has checked that the checkpoint fits; groups the script adds later wait, as on rank 0.
            self._waiting_groups = restore_optimizer(
                self.optimizer, entry["optimizer"], where=f"learner {self.learner_id}'s checkpoint (rank "
                f"{self.group.rank}'s part)", after_load=self._reshard)
        load_buffers(self.model, entry.get("buffers") or {})  # this rank's own (FSDP does not broadcast them)
        saved = entry.get("state", {})
        for name, obj in self.state.items():
            if name in saved:
                obj.load_state_dict(saved[name])
