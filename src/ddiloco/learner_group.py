"""The torch.distributed ranks of one learner: DDP or FSDP2 inside an island.

A learner may be a whole torchrun job (`torchrun --nproc-per-node N train.py`, or `ddiloco run
--nproc-per-learner N`). Its ranks form one process group (the default one, or `group=`), which never
spans learners: a death in one learner stalls no other. Rank 0, the *leader*, runs the whole session
(the `Learner` core, its rules, the gRPC transport, checkpoints); the other ranks, the *followers*, only
answer the leader's commands at the points where every rank calls into `ddiloco.session` anyway (entering
the session, `sync.step()`, leaving it):

- **SET p**: a fragment arrived from the syncer. The leader sends its full float32 value; a replicated
  parameter (DDP, or none) is broadcast whole, a sharded one (FSDP2, a `DTensor`) is scattered so each rank
  receives only its shard.
- **GATHER p**: the leader publishes fragment p. A replicated parameter is read on rank 0 (DDP keeps the
  replicas equal); a sharded one is gathered to full size on every rank (`DTensor.full_tensor()`, an
  all-gather: each rank receives the fragment's full bytes once; rank 0 keeps it until the
  pseudo-gradient is taken).
- **SAVE** / **RESTORE**: the leader's checkpoint holds every rank's `state=` objects (each rank's data
  position differs) and, for sharded parameters, each rank's shard of the optimizer state, gathered as
  objects; a restarted group scatters them back.
- **CHECK p**: at the first read of fragment p (its publish) after the leader sent its value to every rank, every rank
  fingerprints its replica of p's replicated parameters (evenly strided values, each parameter's sum and norm) and
  one small all-reduce compares them. DDP keeps replicas equal; replicas that differ were trained apart (a script
  without DDP or FSDP under `--nproc-per-learner`), and the publish, which reads rank 0's replica only, would throw
  the other ranks' training away while their tokens count: every rank raises `ReplicasDivergedError`, naming the
  cause. Sharded parameters (DTensors: FSDP2, tensor parallel) are each rank's own part and are not compared.
- **STEP** / **END**: at `sync.step(tokens)` the ranks sum their tokens (the learner trained on all of
  them) and any rank's stop request (SIGTERM); at the end of every call the leader tells the followers the
  inner step and whether the loop is done, so every rank leaves the loop after the same inner step.

The ranks meet only where every rank calls in, so two rules hold on every rank: open `ddiloco.session`, and call
`sync.step()` exactly once after each `optimizer.step()`. A rank that breaks them leaves the others waiting in a
collective that never pairs: with DDP or FSDP, the others wait in the training step's own collectives (a gradient
all-reduce) for a rank that waits in ddiloco's for them, and nothing moves. So a rank waits at most `RANK_WAIT_S` (gloo)
where a broken rule shows, then raises `RanksOutOfStepError`, naming the rule: at the session's start every rank waits
for the others (a monitored barrier: rank 0 names the ranks that never came); at STEP rank 0 waits for the others to
call `sync.step()`, and a follower that calls it with no `optimizer.step()` since its last call (a call too many, or a
skipped optimizer step) waits for rank 0. Each STEP also carries rank 0's count of optimizer steps since its last
`sync.step()`: ranks whose counts differ raise at once, on every rank (a script whose training runs no collective).

Commands are broadcast as a small int64 tensor; the leader drives and the followers serve, so every rank
enters the same collectives in the same order. A rank that dies breaks the group's collectives: the
others fail with it, and the launcher (`ddiloco.runtime.rank_group`, or torchrun) restarts the learner's
whole group, which rejoins like any restarted learner.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddiloco.fragment_access import carry_by_copy
from ddiloco.replica_check import check_replicas
from ddiloco.sharded_state import dtensor_type, local_tensors, saved_optimizer_shards

logger = logging.getLogger(__name__)

LEADER = 0
"""The group rank that talks to the syncer (the rank whose parameters DDP's replicas all equal)."""
COMMAND_WORDS = 4
"""A command: (op, argument, argument, argument)."""
RANK_WAIT_S = 300.0
"""The longest a rank waits for the others of its learner where a broken rule shows (the session's start; a
`sync.step()`, see the module docstring), by default (`ddiloco.session(rank_wait_s=...)`). Ranks that train one model
meet at every step in its collectives, so they reach these points within a training step of one another (at the start,
within their own loading or compiling); one that has not come by then waits in a collective of its own for this rank."""
WAIT_SLACK_S = 0.5
"""How much earlier than its deadline a bounded wait may end and still count as the wait timing out: gloo counts the
timeout of a collective from when it was queued, in whole milliseconds (a rank that dies ends the wait at once)."""
RULE = "Every rank must call sync.step() exactly once after each optimizer.step()"


class Op(enum.IntEnum):
    SET = 1
    """(fragment): a new value of the fragment follows."""
    GATHER = 2
    """(fragment): gather the fragment's full value on the leader."""
    SAVE = 3
    """Every rank sends its own state to the leader (gather_object)."""
    RESTORE = 4
    """Every rank receives its own state from the leader (scatter_object_list)."""
    STEP = 5
    """(optimizer steps): sum (tokens, stop requests, ranks whose optimizer steps since their last STEP differ from
    the leader's) over the ranks."""
    END = 6
    """(inner_step, done, exit_status): the session call is over."""
    FORGET = 7
    """Every rank's inner optimizer drops the state that is not finite (`Learner.recover`)."""
    CHECK = 8
    """(fragment): every rank's replica of the fragment's replicated parameters is compared (`check_replicas`)."""


class RanksOutOfStepError(RuntimeError):
    """The ranks of one learner do not meet where they must: a rank did not open `ddiloco.session`, or calls
    `sync.step()` more or less often than the others (see the module docstring). Raised on the rank that waited."""


def _end_at_exit() -> None:
    """A collective of this rank was abandoned (a bounded wait that timed out): gloo's process group waits for it as
    the interpreter tears the group down, up to the group's own timeout (30 minutes by default), and this rank would
    live on that long after its error, the learner's other ranks waiting in their collectives for it. So the process
    ends at exit, after its error is printed and before that teardown (atexit handlers run first), with status 1;
    the other ranks' collectives then fail as its connections close, and the learner's group is restarted."""

    def end() -> None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(end)


def is_distributed(group: Any = None) -> bool:
    """True when torch.distributed runs with more than one rank in `group` (default: the world)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel, `nn.DataParallel` and `torch.compile` wrappers, in any
    nesting (the same parameter objects, without the `module.` and `_orig_mod.` prefixes in their names: exported
    parameters load into the plain model, and wrapped and plain learners of one model join one run)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = inner
        else:
            return model


class LearnerGroup:
    """The leader's or a follower's side of one learner's process group. See the module docstring."""

    def __init__(self, model: nn.Module, *, group: Any = None, rank_wait_s: float | None = None) -> None:
        if not is_distributed(group):
            raise ValueError("LearnerGroup needs torch.distributed initialised with more than one rank")
        rank_wait_s = RANK_WAIT_S if rank_wait_s is None else rank_wait_s
        if not (isinstance(rank_wait_s, int | float) and 0 < rank_wait_s < float("inf")):
            raise ValueError(f"rank_wait_s={rank_wait_s!r} is invalid: expected seconds > 0")
        self.rank_wait_s = float(rank_wait_s)
        """How long this rank waits for the others where a broken rule shows (`RANK_WAIT_S`)."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.leader_global_rank = dist.get_global_rank(group, LEADER) if group is not None else LEADER
        self.params = dict(model.named_parameters())
        dtensor = dtensor_type()
        self.sharded = frozenset(n for n, p in self.params.items() if dtensor is not None and isinstance(p, dtensor))
        """Parameters that are DTensors (FSDP2): each rank holds a shard."""
        backend = dist.get_backend(group)
        self.bounded = backend == "gloo"
        """Whether this rank's waits for the others can be bounded (gloo's `Work.wait(timeout)`, `monitored_barrier`);
        with other backends the process group's own timeout bounds them."""
        # NCCL moves only CUDA tensors; gloo only CPU ones (for the small command tensor).
        self.command_device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                               else torch.device("cpu"))
        self.fragments: tuple[tuple[str, ...], ...] = ()
        """The learner's fragment plan (names per fragment), set by the session on every rank alike."""
        self.stop_requested = False
        """Set by this rank's SIGTERM handler; summed over the ranks at the next STEP."""
        self._sent: set[int] = set()
        """Fragments whose value the leader has sent to every rank (SET): their replicas were equal then."""
        self._checked: set[int] = set()
        """Fragments whose replicas have been compared since (CHECK): once per fragment, at its first publish."""
        self.inner_step = 0
        """The learner's inner step, as the leader last said (END): for the messages of `RanksOutOfStepError`."""
        self._optimizer_steps = 0
        """This rank's optimizer steps since `meet` (a step post-hook)."""
        self._optimizer_steps_at_step = 0
        """`_optimizer_steps` at this rank's last STEP."""

    @property
    def optimizer_shards(self) -> int:
        """Into how many parts this learner's optimizer state is split: one per rank with sharded parameters, else 1
        (replicas hold the same state)."""
        return self.size if self.sharded else 1

    @property
    def leader(self) -> bool:
        return self.rank == LEADER

    # ---- the leader's side (FragmentAccess for the Learner core, and the session's calls) -----------------

    def _command(self, op: Op, *args: int) -> None:
        words = [int(op), *args] + [0] * (COMMAND_WORDS - 1 - len(args))
        dist.broadcast(torch.tensor(words, dtype=torch.int64, device=self.command_device),
                       src=self.leader_global_rank, group=self.group)

    @torch.no_grad()
    def read(self, fragment: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The fragment's full float32 value on the leader (a copy); gathers shards from every rank. At the fragment's
        first read (its publish) after it was sent to every rank, its replicas are compared first (`check_replicas`):
        once per fragment, as one comparison costs a read of the fragment and, on a GPU, a wait for the device."""
        if fragment in self._sent and fragment not in self._checked:
            self._checked.add(fragment)
            if any(name not in self.sharded for name in names):
                self._command(Op.CHECK, fragment)
                self.check_replicas(fragment)
        if any(name in self.sharded for name in names):
            self._command(Op.GATHER, fragment)
        return {name: self._full(name) for name in names}

    def _full(self, name: str) -> torch.Tensor:
        param = self.params[name]
        if name in self.sharded:
            return param.full_tensor().detach().to(torch.float32)  # a new tensor: a copy already
        return param.detach().to(torch.float32, copy=True)

    @torch.no_grad()
    def write(self, fragment: int, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the fragment on every rank with `values` (full tensors, on the leader)."""
        self._command(Op.SET, fragment)
        for name in self.fragments[fragment]:
            self._receive_value(name, values[name])
        self._sent.add(fragment)

    def carry(self, fragment: int, at_publish: Mapping[str, torch.Tensor], bases: Mapping[str, torch.Tensor]) -> None:
        """On the leader's full values, sent to every rank as a write is."""
        carry_by_copy(self, fragment, at_publish, bases)

    def save(self, own: Any) -> list[Any]:
        """Every rank's state (`own` is the leader's), in rank order."""
        self._command(Op.SAVE)
        gathered: list[Any] = [None] * self.size
        dist.gather_object(own, gathered, dst=self.leader_global_rank, group=self.group)
        return gathered

    def restore(self, states: list[Any]) -> None:
        """Send rank r its `states[r]` (the leader's own entry is ignored)."""
        self._command(Op.RESTORE)
        out: list[Any] = [None]
        dist.scatter_object_list(out, list(states), src=self.leader_global_rank, group=self.group)

    def checkpoint(self, learner_state: dict[str, Any]) -> list[Any]:
        """At the leader's checkpoint: every rank's own objects (its data position) and, sharded, its shard of the
        optimizer state; `learner_state["optimizer"]` (the leader's) becomes its shard too, picklable."""
        ranks = self.save(None)
        if self.sharded:
            learner_state["optimizer"] = local_tensors(learner_state["optimizer"])
        return ranks

    def restore_checkpoint(self, ranks: list[Any] | None, saved_optimizer: Mapping[str, Any] | None, *,
                           learner_id: int, optimizer_fits: bool = True) -> None:
        """The leader has loaded its checkpoint (its optimizer included): hand each follower its part. With
        replicated parameters (DDP) the optimizer state is the same on every rank, so it is the leader's as saved
        (`saved_optimizer`, every parameter group: also those the script adds later, `ddiloco.optimizer_restore`);
        with sharded ones (FSDP2) each rank's own shard. Unless `optimizer_fits` (`saved_optimizer_shards`): then the
        state was split otherwise than this learner's, `saved_optimizer` holds the hyperparameters only, and every rank
        takes them, its state starting afresh."""
        same_ranks = ranks is not None and len(ranks) == self.size
        if same_ranks and not optimizer_fits:
            logger.warning("[learner %d] the checkpoint holds the optimizer state %s, this learner's is %s: every "
                           "rank's optimizer state starts afresh (the hyperparameters as saved)", learner_id,
                           _layout(saved_optimizer_shards(ranks)), _layout(self.optimizer_shards))
        elif not same_ranks:
            afresh = ("" if optimizer_fits else f", and every rank its optimizer state "
                      f"({_layout(saved_optimizer_shards(ranks))} when saved; the hyperparameters as saved)")
            logger.warning("[learner %d] the checkpoint holds the state of %s rank(s), this learner has %d: the other "
                           "ranks start their state= objects%s afresh%s", learner_id,
                           "no" if ranks is None else len(ranks), self.size,
                           " (the optimizer is rank 0's)" if optimizer_fits and not self.sharded else "", afresh)
            ranks = [None] * self.size
        own_shards = self.sharded and optimizer_fits
        entries = [{"state": {}, **(entry or {}),
                    "optimizer": (entry or {}).get("optimizer") if own_shards else saved_optimizer} for entry in ranks]
        self.restore(entries)

    def forget_non_finite_state(self) -> int:
        """The followers' inner optimizers drop the state that is not finite (the leader's own is its core's)."""
        self._command(Op.FORGET)
        return 0

    def step(self, tokens: int) -> tuple[int, bool]:
        """The tokens of every rank's batch, summed, and whether any rank was asked to stop. Raises
        `RanksOutOfStepError` when a rank does not call `sync.step()` within `rank_wait_s`, or did after another
        number of optimizer steps than this one."""
        stepped = self._take_optimizer_steps()
        deadline = time.monotonic() + self.rank_wait_s
        words = torch.tensor([int(Op.STEP), stepped, 0, 0], dtype=torch.int64, device=self.command_device)
        self._wait(dist.broadcast(words, src=self.leader_global_rank, group=self.group, async_op=True), deadline,
                   stepped=stepped, others="the other ranks")
        return self._sum_step(tokens, stepped=stepped, leader_stepped=stepped, deadline=deadline)

    def end(self, inner_step: int, *, done: bool, exit_status: int = 0) -> None:
        """The session call is over: the followers return from it with this inner step and `done`."""
        self.inner_step = inner_step
        self._command(Op.END, inner_step, int(done), exit_status)

    # ---- shared by both sides ------------------------------------------------------------------------------

    def meet(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective, as every rank opens its session: wait at most `rank_wait_s` for every rank to open its own
        (`RanksOutOfStepError` naming the ranks that did not), then count this rank's steps of `optimizer` (the rule
        of one `sync.step()` per `optimizer.step()`, checked at each STEP)."""
        self._barrier(self._not_opened)
        # Weakly: the hook stays on an optimizer that a later session reuses, and then counts for no one.
        counts = weakref.ref(self)

        def count(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            if (group := counts()) is not None:
                group._optimizer_steps += 1

        optimizer.register_step_post_hook(count)

    def meet_at_close(self, inner_step: int) -> None:
        """Collective, as every rank's session closes after its loop (not after a failure): wait at most `rank_wait_s`
        for every rank to close its own, else `RanksOutOfStepError` saying which left the loop first. Without it a rank
        that left its loop early (its data ran out, a `break`) waited for the others in its close while they waited
        for it in their next training step's collectives, DDP's or FSDP's, with no message, for gloo's 30 minutes."""
        self.inner_step = inner_step
        self._barrier(self._not_closed)

    def _barrier(self, why: Any) -> None:
        """Every rank meets here within `rank_wait_s`, else `RanksOutOfStepError(why(failure))`: gloo's
        `monitored_barrier`, on a thread of its own, since only rank 0's side of it is bounded (rank 1 waited for a rank
        0 that never came for as long as gloo lets a collective wait, 30 minutes). Other backends have none; their
        collectives end at the process group's own timeout."""
        if not self.bounded:
            return
        outcome: list[BaseException | None] = []
        met = threading.Event()

        def meet() -> None:
            try:
                dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.rank_wait_s),
                                       wait_all_ranks=True)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
                outcome.append(exc)
            met.set()

        started = time.monotonic()
        threading.Thread(target=meet, name="ddiloco-ranks-meet", daemon=True).start()
        if not met.wait(self.rank_wait_s + 1.0):
            _end_at_exit()  # the barrier's thread is still in the collective: gloo's teardown would wait for it
            raise RanksOutOfStepError(why(""))
        failure = outcome[0]
        if failure is None:
            return
        if not isinstance(failure, RuntimeError) or time.monotonic() - started < self.rank_wait_s - WAIT_SLACK_S:
            raise failure  # the group broke (a rank died, or rank 0 raised this for another rank)
        _end_at_exit()
        raise RanksOutOfStepError(why(str(failure))) from None

    def _not_closed(self, failure: str) -> str:
        if not self.leader:
            others = "rank 0 did not leave its own"
        else:
            missing = re.search(r"Ranks? ([0-9, ]+) failed to pass monitoredBarrier", failure)
            others = f"rank(s) {missing[1].strip() if missing else 'some'} did not leave theirs"
        return (f"rank {self.rank} of this learner left its training loop at inner step {self.inner_step} (its "
                f"session closed), and {others} within {self.rank_wait_s:g} s: every rank must leave the loop at the "
                "same step. "
                "Loop `while not sync.done` on every rank (it turns true on all of them at once); a rank whose data "
                "ends first must tell the others (an all_reduce of a flag each step), not break alone")

    def _not_opened(self, failure: str) -> str:
        if not self.leader:
            return (f"rank {self.rank} of this learner waited {self.rank_wait_s:g} s in ddiloco.session(...) for "
                    "rank 0 to open its session: every rank of a learner must open it, rank 0 included")
        missing = re.search(r"Ranks? ([0-9, ]+) failed to pass monitoredBarrier", failure)
        ranks = missing[1].strip() if missing else "some"
        return (f"rank(s) {ranks} of this learner did not open ddiloco.session(...) within {self.rank_wait_s:g} s of "
                "rank 0: every rank of a learner must open it (`with ddiloco.session(model, optimizer) as sync:` on "
                "every rank, not only on rank 0), and every rank call sync.step() once after each optimizer.step()")

    def _take_optimizer_steps(self) -> int:
        """This rank's optimizer steps since its last STEP."""
        stepped = self._optimizer_steps - self._optimizer_steps_at_step
        self._optimizer_steps_at_step = self._optimizer_steps
        return stepped

    def _wait(self, work: Any, deadline: float | None, *, stepped: int, others: str) -> None:
        """Wait for a collective of a `sync.step()` call, until `deadline` (monotonic) where one is set and the
        backend bounds waits; past it, `RanksOutOfStepError` (`stepped`: this rank's optimizer steps since its last
        `sync.step()`; `others`: whom it waited for)."""
        if deadline is None or not self.bounded:
            work.wait()
            return
        try:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.0)))
        except RuntimeError:
            if time.monotonic() < deadline - WAIT_SLACK_S:
                raise  # the group broke (a rank died): not a rank out of step
            _end_at_exit()
            raise RanksOutOfStepError(self._late(stepped, others)) from None

    def _late(self, stepped: int, others: str) -> str:
        """Why this rank waited `rank_wait_s` in a `sync.step()` call for `others`."""
        where = f"rank {self.rank} of this learner"
        one = others == "rank 0"
        if stepped == 0:
            return (f"{where} called sync.step() at inner step {self.inner_step} without an optimizer.step() since its "
                    f"last sync.step(), and {others} {'has' if one else 'have'} not called sync.step() within "
                    f"{self.rank_wait_s:g} s: this is a sync.step() too many ({others} {'waits' if one else 'wait'} "
                    f"meanwhile in {'its' if one else 'their'} own training step's collectives, DDP's or FSDP's, for "
                    f"this rank). {RULE}")
        return (f"{where} waited {self.rank_wait_s:g} s in sync.step() at inner step {self.inner_step} for {others} to "
                "call it: a rank that skipped a sync.step() waits meanwhile in its next training step's collectives "
                f"(DDP's or FSDP's) for this one. {RULE}")

    def check_replicas(self, fragment: int) -> None:
        """Collective: every rank's replica of the fragment's replicated parameters compared
        (`ddiloco.replica_check`); `ReplicasDivergedError` on every rank when they differ."""
        names = [name for name in self.fragments[fragment] if name not in self.sharded]
        check_replicas({name: self.params[name] for name in names}, fragment=fragment, ranks=self.size,
                       group=self.group, device=self.command_device)

    def _sum_step(self, tokens: int, *, stepped: int, leader_stepped: int, deadline: float | None
                  ) -> tuple[int, bool]:
        """Collective: (tokens, stop requests) summed over the ranks; `RanksOutOfStepError` on every rank when any
        rank's optimizer steps since its last STEP (`stepped`) differ from the leader's."""
        apart = int(stepped != leader_stepped)
        counts = torch.tensor([tokens, int(self.stop_requested), apart], dtype=torch.int64, device=self.command_device)
        self._wait(dist.all_reduce(counts, group=self.group, async_op=True), deadline, stepped=stepped,
                   others="the other ranks")
        if not int(counts[2]):
            return int(counts[0]), bool(counts[1])
        if apart:
            raise RanksOutOfStepError(
                f"rank {self.rank} of this learner called sync.step() at inner step {self.inner_step} after {stepped} "
                f"optimizer.step() call(s) since its last sync.step(), rank 0 after {leader_stepped}: the ranks are "
                f"out of step. {RULE}")
        raise RanksOutOfStepError(
            f"{int(counts[2])} rank(s) of this learner called sync.step() at inner step {self.inner_step} after "
            f"another number of optimizer.step() calls since their last sync.step() than rank 0 ({leader_stepped}): "
            f"the ranks are out of step. {RULE}")

    def _receive_value(self, name: str, value: torch.Tensor | None) -> None:
        """Collective: the leader passes the full value, followers None; each rank's parameter takes it."""
        param = self.params[name]
        if name in self.sharded:
            from torch.distributed.tensor import distribute_tensor

            full = (value.to(device=param.device, dtype=param.dtype) if value is not None
                    else torch.empty(param.shape, dtype=param.dtype, device=param.device))
            # Scattered from the leader: each rank receives its own shard only.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=self.leader_global_rank)
            param.to_local().copy_(shard.to_local())
            return
        if value is not None:
            param.copy_(value)
        dist.broadcast(param.data, src=self.leader_global_rank, group=self.group)

    # ---- the followers' side -------------------------------------------------------------------------------

    @torch.no_grad()
    def serve(self, *, tokens: int = 0, stepping: bool = False, save: Any = None, restore: Any = None,
              forget: Any = None) -> tuple[int, bool, int]:
        """A follower inside a session call: answer the leader's commands until END; returns (inner_step, done,
        exit_status). `tokens`: this rank's batch at STEP; `stepping`: the call is a `sync.step()`; `save()` gives its
        state at SAVE; `restore(state)` takes it back at RESTORE; `forget()` drops its optimizer's state that is not
        finite at FORGET."""
        # A sync.step() with no optimizer.step() since the last one may be one too many: rank 0 then never calls its
        # own, and waits in the training step's collectives for this rank. Its first command is waited for a bounded
        # time (once it came, rank 0 is in the call; what it does there, waiting for the syncer, is not bounded).
        suspect = stepping and self._optimizer_steps == self._optimizer_steps_at_step
        deadline = time.monotonic() + self.rank_wait_s if suspect else None
        while True:
            words = torch.zeros(COMMAND_WORDS, dtype=torch.int64, device=self.command_device)
            self._wait(dist.broadcast(words, src=self.leader_global_rank, group=self.group, async_op=True), deadline,
                       stepped=0, others="rank 0")
            deadline = None
            op, a, b, c = (int(w) for w in words.tolist())
            if op == Op.SET:
                for name in self.fragments[a]:
                    self._receive_value(name, None)
            elif op == Op.GATHER:
                for name in self.fragments[a]:
                    if name in self.sharded:
                        self.params[name].full_tensor()  # this rank's part of the all-gather
            elif op == Op.SAVE:
                dist.gather_object(save() if save is not None else None, None, dst=self.leader_global_rank,
                                   group=self.group)
            elif op == Op.RESTORE:
                out: list[Any] = [None]
                dist.scatter_object_list(out, None, src=self.leader_global_rank, group=self.group)
                if restore is not None and out[0] is not None:
                    restore(out[0])
            elif op == Op.CHECK:
                self.check_replicas(a)
            elif op == Op.FORGET:
                if forget is not None:
                    forget()
            elif op == Op.STEP:
                self._sum_step(tokens, stepped=self._take_optimizer_steps(), leader_stepped=a,
                               deadline=time.monotonic() + self.rank_wait_s)
            elif op == Op.END:
                self.inner_step = a
                return a, bool(b), c
            else:
                raise RuntimeError(f"unknown learner-group command {op} from the leader")


def _layout(shards: int) -> str:
    return "whole" if shards == 1 else f"sharded over {shards} ranks"
