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

Commands are broadcast as a small int64 tensor; the leader drives and the followers serve, so every rank
enters the same collectives in the same order. A rank that dies breaks the group's collectives: the
others fail with it, and the launcher (`ddiloco.runtime.rank_group`, or torchrun) restarts the learner's
whole group, which rejoins like any restarted learner.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

LEADER = 0
"""The group rank that talks to the syncer (the rank whose parameters DDP's replicas all equal)."""
COMMAND_WORDS = 4
"""A command: (op, argument, argument, argument)."""


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
    """Sum (tokens, stop requests) over the ranks."""
    END = 6
    """(inner_step, done, exit_status): the session call is over."""
    FORGET = 7
    """Every rank's inner optimizer drops the state that is not finite (`Learner.recover`)."""
    CHECK = 8
    """(fragment): every rank's replica of the fragment's replicated parameters is compared (`check_replicas`)."""


REPLICA_SAMPLES = 1024
"""Values of a fragment compared across the ranks one by one (evenly strided over its parameters), besides each
parameter's sum and norm: a fingerprint of about 9 KB a rank in float64, reduced once per fragment."""
REPLICA_TOLERANCE = 1e-6
"""Relative difference between ranks' fingerprints that counts as replicas trained apart. Replicas that DDP keeps
equal are equal to the bit on one kind of device (the same gradients after the all-reduce, the same optimizer step);
this leaves about 8 float32 ulps for a reduction order that differs between devices. Replicas trained apart for the
inner steps of one period differ by a learning rate's step or more."""
REPLICA_TOLERANCE_ABS = 1e-12
"""Absolute slack beside `REPLICA_TOLERANCE`, for values at or near 0."""


class ReplicasDivergedError(RuntimeError):
    """The ranks of one learner hold different values of parameters that are meant to be replicas: they trained
    apart (no DistributedDataParallel or FSDP around the model). Raised on every rank at once."""


def is_distributed(group: Any = None) -> bool:
    """True when torch.distributed runs with more than one rank in `group` (default: the world)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel and `torch.compile` wrappers, in any nesting (the same
    parameter objects, without the `module.` and `_orig_mod.` prefixes in their names: exported parameters load
    into the plain model, and compiled and plain learners of one model join one run)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = inner
        else:
            return model


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no FSDP2 either
        return None
    return DTensor


class LearnerGroup:
    """The leader's or a follower's side of one learner's process group. See the module docstring."""

    def __init__(self, model: nn.Module, *, group: Any = None) -> None:
        if not is_distributed(group):
            raise ValueError("LearnerGroup needs torch.distributed initialised with more than one rank")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.leader_global_rank = dist.get_global_rank(group, LEADER) if group is not None else LEADER
        self.params = dict(model.named_parameters())
        dtensor = _dtensor_type()
        self.sharded = frozenset(n for n, p in self.params.items() if dtensor is not None and isinstance(p, dtensor))
        """Parameters that are DTensors (FSDP2): each rank holds a shard."""
        backend = dist.get_backend(group)
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

    def restore_checkpoint(self, ranks: list[Any] | None, saved_optimizer: Mapping[str, Any], *,
                           learner_id: int) -> None:
        """The leader has loaded its checkpoint (its optimizer included): hand each follower its part. With
        replicated parameters (DDP) the optimizer state is the same on every rank, so it is the leader's as saved
        (`saved_optimizer`, every parameter group: also those the script adds later, `ddiloco.optimizer_restore`)."""
        if ranks is None or len(ranks) != self.size:
            logger.warning("[learner %d] the checkpoint holds the state of %s rank(s), this learner has %d: the "
                           "other ranks start their state=%s afresh", learner_id,
                           "no" if ranks is None else len(ranks), self.size,
                           " objects and optimizer shards" if self.sharded else " objects (the optimizer is rank 0's)")
            ranks = [None] * self.size
        shared = None if self.sharded else saved_optimizer
        entries = [{"state": {}, "optimizer": shared} if entry is None else
                   {**entry, "optimizer": entry.get("optimizer") if self.sharded else shared} for entry in ranks]
        self.restore(entries)

    def forget_non_finite_state(self) -> int:
        """The followers' inner optimizers drop the state that is not finite (the leader's own is its core's)."""
        self._command(Op.FORGET)
        return 0

    def step(self, tokens: int) -> tuple[int, bool]:
        """The tokens of every rank's batch, summed, and whether any rank was asked to stop."""
        self._command(Op.STEP)
        return self._sum_step(tokens)

    def end(self, inner_step: int, *, done: bool, exit_status: int = 0) -> None:
        """The session call is over: the followers return from it with this inner step and `done`."""
        self._command(Op.END, inner_step, int(done), exit_status)

    # ---- shared by both sides ------------------------------------------------------------------------------

    @torch.no_grad()
    def check_replicas(self, fragment: int) -> None:
        """Collective: compare every rank's replica of the fragment's replicated parameters, by one all-reduce (MAX)
        of each rank's fingerprint and its negation; raise `ReplicasDivergedError` on every rank when they differ."""
        names = [name for name in self.fragments[fragment] if name not in self.sharded]
        total = sum(self.params[name].numel() for name in names)
        stride = max(1, total // REPLICA_SAMPLES)
        parts, sizes = [], []
        for name in names:
            flat = self.params[name].detach().reshape(-1)
            values = flat.float()
            summary = torch.stack([values.sum(), torch.linalg.vector_norm(values)]) if flat.numel() else values
            part = torch.cat([flat[::stride].to(torch.float64), summary.to(torch.float64)])
            parts.append(part.to(self.command_device))
            sizes.append(part.numel())
        fingerprint = torch.cat(parts)
        extremes = torch.cat([fingerprint, -fingerprint])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        high, low = extremes[:fingerprint.numel()], -extremes[fingerprint.numel():]
        spread = (high - low).cpu()
        bound = (REPLICA_TOLERANCE * torch.maximum(high.abs(), low.abs()) + REPLICA_TOLERANCE_ABS).cpu()
        apart = spread > bound  # (NaN compares False: a non-finite replica is `Learner.recover`'s business)
        if not bool(apart.any()):
            return
        first = int(apart.nonzero()[0])
        offsets = torch.tensor(sizes).cumsum(0)
        name = names[int((offsets <= first).sum())]
        raise ReplicasDivergedError(
            f"the {self.size} ranks of this learner hold different values of parameter {name!r} (fragment "
            f"{fragment}: their sums, norms or sampled values differ by up to {float(spread.max()):.3g}, inner steps "
            "after rank 0's value was sent to every rank): they trained apart, and ddiloco publishes rank 0's copy "
            "only, so the other ranks' training would be thrown away at every sync while their tokens count. Wrap "
            "the model in DistributedDataParallel (or shard it with FSDP2's fully_shard) so that the ranks train one "
            "model together, or run one process per learner (no --nproc-per-learner; more --learners instead)")

    def _sum_step(self, tokens: int) -> tuple[int, bool]:
        counts = torch.tensor([tokens, int(self.stop_requested)], dtype=torch.int64, device=self.command_device)
        dist.all_reduce(counts, group=self.group)
        return int(counts[0]), bool(counts[1])

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
    def serve(self, *, tokens: int = 0, save: Any = None, restore: Any = None, forget: Any = None
              ) -> tuple[int, bool, int]:
        """A follower inside a session call: answer the leader's commands until END; returns (inner_step, done,
        exit_status). `tokens`: this rank's batch at STEP; `save()` gives its state at SAVE; `restore(state)`
        takes it back at RESTORE; `forget()` drops its optimizer's state that is not finite at FORGET."""
        while True:
            words = torch.zeros(COMMAND_WORDS, dtype=torch.int64, device=self.command_device)
            dist.broadcast(words, src=self.leader_global_rank, group=self.group)
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
                self._sum_step(tokens)
            elif op == Op.END:
                return a, bool(b), c
            else:
                raise RuntimeError(f"unknown learner-group command {op} from the leader")


# ---- optimizer state of sharded parameters -------------------------------------------------------------------

def local_tensors(state: Any) -> Any:
    """`state` with every DTensor replaced by this rank's shard (a plain tensor): picklable, and what this rank
    alone must keep of a sharded optimizer state."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(state, dtensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {key: local_tensors(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_tensors(value) for value in state)
    return state


def reshard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict` of `local_tensors` output: each state tensor of a DTensor parameter
    becomes a DTensor of that parameter's layout again (the optimizer step mixes it with DTensor gradients)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for param, state in optimizer.state.items():
        if not isinstance(param, dtensor):
            continue
        local_shape = param.to_local().shape
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.shape == local_shape:
                state[key] = dtensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
