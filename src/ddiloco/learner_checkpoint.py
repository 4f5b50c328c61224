"""The checkpoint of a learner session (`ddiloco.learner_session.Session`): `learners/N/checkpoint/`.

Owns what a learner keeps across a restart and how: the learner core's state (its progress, schedule position and
inner optimizer), the model's buffers (`ddiloco.model_buffers`: not synchronised, the learner's own), every object
the user passed as `state=` (a data loader, a scheduler), the other ranks' own objects, buffers and optimizer
shards (`LearnerGroup.checkpoint`), and the totals the status reports (tokens, counters). Each checkpoint also
writes the buffers to `learners/N/buffers.safetensors`, which export and the evaluator average, and the global
fragments the learner holds to `learners/N/global.safetensors` (`ddiloco.global_copy`). The snapshot is
taken between inner steps, on the training thread, and split there into tensors and JSON, so that a value the
checkpoint cannot keep (a set in a `state_dict()`) is a TypeError in the user's loop, naming the entry; writing and
fsyncing happen in a background thread, one write at a time, and a write that fails (a full disk) is logged and tried
again at the next checkpoint; the inner step of the newest one written goes to the status (`checkpoint_inner_step`),
and the checkpoint at the stop, which no later one retries, is an error when it fails, naming the inner step a resume
continues from. Restoring loads the latest readable checkpoint back into all of them, once its optimizer
state is known to fit this script's optimizer (`ddiloco.optimizer_restore`: parameter groups the script added during
the run are restored when it adds them again, and kept by the checkpoints taken meanwhile). Each checkpoint records
who wrote it (`writer`): the optimizer's class, this process, and which model and optimizer object. Its optimizer
state is not loaded into an optimizer of another class (a warning names both), nor into another optimizer object than
the one that wrote it when an earlier session of this same process wrote it with the same model (a script that
switches optimizers between two sessions: the new one keeps its own hyperparameters). Nor is the state of each
parameter loaded when it was split otherwise than this learner's (FSDP2 shards of another number of ranks, or a whole
state into shards): every rank then takes the saved hyperparameters only, and its moments start afresh. A restarted
process, or a script that builds its model anew, gets the optimizer state back as saved. When to checkpoint, and what a
resumed learner does next, is the session's business; the file format is `ddiloco.checkpoint`'s.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ddiloco.checkpoint import WriteTrouble, load_latest_state, save_split_state
from ddiloco.global_copy import GLOBAL_COPY_FILE
from ddiloco.global_copy import snapshot as snapshot_global_copy
from ddiloco.global_copy import write as write_global_copy
from ddiloco.learner import Learner
from ddiloco.learner_group import LearnerGroup
from ddiloco.learner_status import StatusReporter
from ddiloco.model_buffers import load_buffers, snapshot_buffers, write_buffers
from ddiloco.optimizer_restore import WaitingGroups, optimizer_class, restore_optimizer
from ddiloco.sharded_state import reshard_optimizer, saved_optimizer_shards
from ddiloco.state_tree import CHECKPOINTABLE, UnsupportedStateError, split_state, state_path

logger = logging.getLogger(__name__)

PROCESS = uuid.uuid4().hex
"""This process, as its checkpoints record it: a checkpoint read back with this value was written by an earlier session
of the same process (a restarted process has another)."""
_serials: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_next_serial = itertools.count()


def _serial(obj: Any) -> int:
    """A number for `obj` unique in this process, never reused (an `id()` is, once the object is gone)."""
    if obj not in _serials:
        _serials[obj] = next(_next_serial)
    return _serials[obj]


class Stateful(Protocol):
    """An object the checkpoint keeps (`state=`): a data loader, a scheduler, anything with these two methods."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


class GeneratorState:
    """A `torch.Generator` as a `state=` entry: its state is its random state (a data order drawn from it resumes
    where it stopped)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"rng_state": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.generator.set_state(state["rng_state"])


def stateful_objects(state: Mapping[str, Any] | None) -> dict[str, Stateful]:
    """The user's `state=` as the checkpoint keeps it: a `torch.Generator` as `GeneratorState`; anything else must
    have state_dict() and load_state_dict() (TypeError naming the entry)."""
    objects: dict[str, Stateful] = {}
    for name, obj in (state or {}).items():
        if isinstance(obj, torch.Generator):
            obj = GeneratorState(obj)
        if isinstance(obj, torch.utils.data.DataLoader) and not callable(getattr(obj, "state_dict", None)):
            raise TypeError(f"state[{name!r}] is a torch DataLoader, which keeps no position to checkpoint: pass "
                            "torchdata's StatefulDataLoader, or the torch.Generator its sampler draws from "
                            "(DataLoader(..., generator=g), state={'order': g})")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"state[{name!r}] ({type(obj).__name__}) needs state_dict() and load_state_dict() "
                            "(or is a torch.Generator)")
        objects[name] = obj
    return objects


class LearnerCheckpoint:
    """The checkpoints in `directory` of one learner (see the module docstring)."""

    def __init__(self, directory: Path, *, learner: Learner, state: Mapping[str, Stateful],
                 group: LearnerGroup | None, reporter: StatusReporter) -> None:
        self.directory = directory
        self.learner = learner
        self.state = state
        self.group = group
        self.reporter = reporter
        self.checked = False
        """Whether `check()` has run (the session calls it once, at its first inner step)."""
        self._writes = WriteTrouble(f"learner {learner.learner_id}'s checkpoint")
        self._copy_writes = WriteTrouble(f"learner {learner.learner_id}'s copy of the global model "
                                         f"({GLOBAL_COPY_FILE})")
        self._saver: threading.Thread | None = None
        self._unsupported_raised = False
        """Whether a state the checkpoint cannot keep has been raised as a TypeError (`_split`)."""
        self._said_overdue = False
        """Whether a checkpoint due while the one before was written has been logged (`overdue`)."""
        self.waiting_groups: WaitingGroups | None = None
        """Optimizer parameter groups of the restored checkpoint that the script has not added yet
        (`ddiloco.optimizer_restore`)."""
        self.restored_versions: list[int] | None = None
        """The global model's versions the restored checkpoint was taken at (None: none restored, or one written
        before checkpoints kept them): `foreign` compares them with the syncer's."""

    @property
    def writing(self) -> bool:
        """Whether a checkpoint is being written in the background now."""
        return self._saver is not None and self._saver.is_alive()

    def overdue(self, every_s: float) -> None:
        """A periodic checkpoint fell due while the one before is still being written: it is taken once that write
        ends, not by joining it (which stopped the training loop for the rest of the write). Said once."""
        if self._said_overdue:
            return
        self._said_overdue = True
        logger.warning("[learner %d | inner %d] its checkpoint takes longer to write than checkpoint_every_s (%g s): "
                       "each is taken once the one before is written, back to back (the training loop does not wait "
                       "for them; a larger --checkpoint-every-s writes less often)",
                       self.learner.learner_id, self.learner.inner_step, every_s)

    def _user_state(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.state.items()}

    def check(self) -> None:
        """Raise TypeError, naming the entry and the place in it, when a `state=` object's state_dict() holds a value
        a checkpoint cannot keep. The session calls it at its first inner step, so that such a state stops the loop at
        once rather than at the first checkpoint (`checkpoint_every_s` in) or as the session ends."""
        self.checked = True
        self._split({"state": self._user_state()})

    def save(self, *, wait: bool = True) -> None:
        """Checkpoint. The snapshot is taken and split here, between inner steps (a deep copy: the optimizer updates
        its tensors in place); writing and fsyncing happen in a background thread unless `wait`, so a periodic
        checkpoint costs the training loop only the copy. A state that cannot be kept raises TypeError here (see
        `_split`). `wait` is the session's checkpoint at its stop: no later one will try again, so when it cannot be
        written the error says which inner step a resume continues from (`_unsaved`)."""
        if self._saver is not None:
            self._saver.join()  # one write at a time, in order
        user = self._user_state()
        if self.waiting_groups is not None:  # first the groups added since, then the state with them
            self.waiting_groups = self.waiting_groups.settle()
        learner = self.learner.state_dict()
        if self.waiting_groups is not None:
            # Parameter groups the script has not added again since the restart stay in the checkpoint.
            learner["optimizer"] = self.waiting_groups.append_to(learner["optimizer"])
        ranks = self.group.checkpoint(learner) if self.group is not None else None
        buffers = snapshot_buffers(self.learner.model)
        global_copy = snapshot_global_copy(self.learner)
        state = {"learner": learner, "state": user, "buffers": buffers, "writer": self._writer()}
        if ranks is not None:
            state["ranks"] = ranks
        split = self._split(state)
        if split is None:
            return
        # The snapshot: the split's tree is new containers of immutable values, so only its tensors are copied (the
        # optimizer and the user's objects update theirs in place). A deep copy of the whole state took 0.7-1.2 s here
        # for a model of 10,000 tensors, more than a step of it (`benchmarks/bench_many_tensors.py`).
        split = ({path: tensor.detach().clone() for path, tensor in split[0].items()}, split[1])
        meta = {"tokens": self.reporter.progress.tokens, "counters": self.reporter.counters()}
        serial = self.learner.inner_step

        def write() -> None:
            save_split_state(self.directory, split, serial=serial, meta=meta)
            self.reporter.checkpoint_inner_step = serial  # durable from here, even if the buffers file fails next
            write_buffers(self.directory.parent, buffers)
            # Its own trouble: a failing copy is not a failing checkpoint (which is durable by now).
            self._copy_writes.attempt(lambda: write_global_copy(self.directory.parent, global_copy))

        # A checkpoint that cannot be written (a full disk) is logged, and the next one tries again.
        self._saver = threading.Thread(target=self._writes.attempt, args=(write,), name="learner-checkpoint",
                                       daemon=True)
        self._saver.start()
        if wait:
            self._saver.join()
            if self.reporter.checkpoint_inner_step != serial:
                self._unsaved(serial)

    def _unsaved(self, inner_step: int) -> None:
        """Log that the checkpoint at the stop, at `inner_step`, could not be written: `WriteTrouble` says only the
        first failure of a run of them, and the progress since the newest checkpoint is trained again on resume."""
        saved = self.reporter.checkpoint_inner_step
        if saved is None:
            lost = ("it has no checkpoint, so a resume takes the run's position, with its optimizer and state= "
                    "objects afresh")
        else:
            lost = f"its progress since inner step {saved} is not saved, a resume continues from inner step {saved}"
        logger.error("[learner %d | inner %d] its checkpoint at its stop could not be written (%s): %s",
                     self.learner.learner_id, inner_step, self._writes.failing or "the writing thread's error above",
                     lost)

    def _split(self, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any] | None:
        """`split_state(state)`, on the training thread. A value it cannot keep is a TypeError naming the entry the
        first time; after that (the session's last checkpoint, as it closes after that very error) the checkpoint is
        skipped with the reason logged, so that the error is not raised again over the first. None when skipped."""
        try:
            return split_state(state)
        except UnsupportedStateError as exc:
            reason = self._describe_unsupported(exc)
            if not self._unsupported_raised:
                self._unsupported_raised = True
                raise TypeError(reason) from None
            logger.error("[learner %d | inner %d] no checkpoint: %s", self.learner.learner_id, self.learner.inner_step,
                         reason)
            return None

    def _describe_unsupported(self, exc: UnsupportedStateError) -> str:
        """What the user reads when a checkpoint cannot keep a value: whose state_dict() holds it, where, what to do."""
        keys = exc.keys
        if keys[:1] == ("state",) and len(keys) >= 2:
            owner, within = f"state[{keys[1]!r}].state_dict()", keys[2:]
        elif keys[:1] == ("ranks",) and keys[2:3] == ("state",) and len(keys) >= 4:
            owner, within = f"rank {keys[1]}'s state[{keys[3]!r}].state_dict()", keys[4:]
        elif keys[:2] == ("learner", "optimizer"):
            owner, within = "the optimizer's state_dict()", keys[2:]
        else:
            owner, within = "the learner's state", keys
        return (f"learner {self.learner.learner_id} cannot checkpoint the {exc.what} at {state_path(within)} in "
                f"{owner}. A checkpoint keeps {CHECKPOINTABLE}: have state_dict() return only those (a set as a sorted "
                "list, an object as a dict of its fields) and load_state_dict() rebuild the rest")

    def restore(self) -> bool:
        """Load the latest readable checkpoint, if any; False when there is none."""
        learner_id = self.learner.learner_id
        latest = load_latest_state(self.directory)
        if latest is None:
            # (a damaged one is logged by load_latest_state, naming its files)
            logger.info("[learner %d] no readable checkpoint in %s: fresh optimizer, data from the start",
                        learner_id, self.directory)
            return False
        state, meta, serial = latest
        self.reporter.checkpoint_inner_step = self.reporter.restored_inner_step = serial
        versions = state["learner"].get("versions")
        if isinstance(versions, list) and len(versions) == self.learner.plan.num_fragments:
            self.restored_versions = [int(v) for v in versions]
        saved_optimizer = state["learner"]["optimizer"]
        ranks = state.get("ranks")
        fits = True
        if self._loads_optimizer(state.get("writer")):
            fits = self._optimizer_fits(ranks)
            if not fits:  # its hyperparameters only: the state of each parameter starts afresh, on every rank
                saved_optimizer = {**saved_optimizer, "state": {}}
            # The optimizer is loaded before the join, where a changed model would be refused: without the check in
            # restore_optimizer torch's own error ("a parameter group that doesn't match the size of optimizer's
            # group") ended every restart, saying neither which learner nor why.
            self.waiting_groups = restore_optimizer(
                self.learner.optimizer, saved_optimizer, where=f"learner {learner_id}'s checkpoint in {self.directory}",
                load=lambda fits: self.learner.load_state_dict({**state["learner"], "optimizer": fits}),
                after_load=self._reshard)
        else:  # the progress and schedule position as saved; the optimizer as the script built it
            self.learner.load_state_dict({**state["learner"], "optimizer": self.learner.optimizer.state_dict()})
            saved_optimizer = None
            ranks = None if ranks is None else [entry if entry is None else {**entry, "optimizer": None}
                                                for entry in ranks]
        # A checkpoint written before it kept them holds none: the buffers stay as the script built them.
        load_buffers(self.learner.model, state.get("buffers", {}))
        if self.group is not None:
            self.group.restore_checkpoint(ranks, saved_optimizer, learner_id=learner_id, optimizer_fits=fits)
        saved = state.get("state", {})
        for name, obj in self.state.items():
            if name in saved:
                obj.load_state_dict(saved[name])
            else:
                logger.warning("[learner %d] the checkpoint holds no state[%r]: it starts afresh", learner_id, name)
        self.reporter.resume(tokens=int(meta.get("tokens", 0)), counters=meta.get("counters", {}))
        return True

    def foreign(self, versions: list[int]) -> str | None:
        """Why the restored checkpoint is not this run's, or None: the syncer this learner joined holds an older version
        of a fragment than the checkpoint was taken at (`versions`: the syncer's, as its Welcome gave them). A syncer
        never goes back (a round is durable before it is sent), so the checkpoint is another run's: a learner's run
        directory used again for a new run resumed that run's progress, optimizer and data position in silence."""
        if self.restored_versions is None:
            return None
        for fragment, (saved, now) in enumerate(zip(self.restored_versions, versions, strict=True)):
            if now < saved:
                return (f"learner {self.learner.learner_id}'s checkpoint in {self.directory} was taken at version "
                        f"{saved} of fragment {fragment} of the global model, and the syncer holds version {now}: a "
                        "syncer never goes back, so the checkpoint is another run's (a run directory used again for "
                        "a new run), or the syncer's run directory was replaced. Give this learner a new --run-dir "
                        f"(or move {self.directory.parent} aside) to join this run afresh")
        return None

    def _writer(self) -> dict[str, Any]:
        """Who writes this checkpoint: the optimizer's class, this process, its model and optimizer object."""
        return {"optimizer_class": optimizer_class(self.learner.optimizer), "process": PROCESS,
                "model": _serial(self.learner.model), "optimizer": _serial(self.learner.optimizer)}

    def _loads_optimizer(self, writer: Mapping[str, Any] | None) -> bool:
        """Whether the checkpoint `writer` wrote holds this session's optimizer state (see the module docstring);
        says why not when it does not. A checkpoint from before they recorded their writer (None) is loaded."""
        if writer is None:
            return True
        learner_id, mine = self.learner.learner_id, self._writer()
        if writer["optimizer_class"] != mine["optimizer_class"]:
            logger.warning("[learner %d] the checkpoint in %s holds the optimizer state of a %s, but this session's "
                           "optimizer is a %s: it is not loaded, and the optimizer starts afresh with its own "
                           "hyperparameters (the inner step and state= objects resume as saved)", learner_id,
                           self.directory, writer["optimizer_class"], mine["optimizer_class"])
            return False
        earlier_session = (writer["process"], writer["model"]) == (PROCESS, mine["model"])
        if earlier_session and writer["optimizer"] != mine["optimizer"]:
            logger.info("[learner %d] the checkpoint in %s was written by an earlier session of this process with "
                        "another optimizer: this session's optimizer keeps its own hyperparameters and state",
                        learner_id, self.directory)
            return False
        return True

    def _optimizer_fits(self, ranks: list[Any] | None) -> bool:
        """Whether the checkpoint's optimizer state is split as this learner's: sharded over as many ranks (each rank
        loads its own shard), or whole (DDP's replicas, one process). A shard of another split fits no parameter of
        this one (rank 0 kept its old shard as plain tensors, and its first optimizer.step() failed mixing them with
        DTensor gradients). A learner of several ranks says so with the rest of the ranks' state
        (`LearnerGroup.restore_checkpoint`)."""
        shards = self.group.optimizer_shards if self.group is not None else 1
        saved = saved_optimizer_shards(ranks)
        if saved == shards:
            return True
        if self.group is None:
            logger.warning("[learner %d] the checkpoint in %s holds the optimizer state sharded over %d ranks, this "
                           "learner is one process: its optimizer state starts afresh (the hyperparameters as saved)",
                           self.learner.learner_id, self.directory, saved)
        return False

    def _reshard(self) -> None:
        """After an optimizer load on a learner of FSDP2 shards: its state tensors become DTensors again."""
        if self.group is not None and self.group.sharded:
            reshard_optimizer(self.learner.optimizer)
