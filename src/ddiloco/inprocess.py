"""In-process transport: learners and the syncer in one Python process, messages delivered at once.

The smallest driver of the sans-I/O cores, for notebooks, tests and the in-process form of
`ddiloco.session(..., hub=hub)`. There is no network, no thread and no serialisation: a learner's
messages reach the syncer when the learner sends them, and the syncer's answers are handed to the
learner's `deliver` callback before the call returns. Learners of one hub may train on threads of their own: one
lock keeps the syncer core to one call at a time (without it, two threads corrupted its rounds).

Like the real syncer, a hub made without a `Syncer` takes its genesis from the first learner that
joins: its initial parameters become the global model; every later learner loads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ddiloco.clock import Clock, MonotonicClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.learner import Learner
from ddiloco.learner_group import unwrap
from ddiloco.messages import Commit, Join, LearnerMessage, Leave, RoundRecord, Send, SyncerAction, SyncerMessage
from ddiloco.syncer import Syncer

Deliver = Callable[[SyncerMessage], None]
GenesisSource = Callable[[], tuple[Mapping[str, torch.Tensor], tuple[str, ...]]]
"""() -> (initial parameters, embedding names) of a learner, asked for only by a hub without a syncer."""


class JoinRefusedError(RuntimeError):
    """The syncer refused a learner (different model, config or schema); the message says why."""


class InProcessHub:
    """Routes messages between a `Syncer` and the learners connected to it, in one process."""

    def __init__(self, syncer: Syncer | None = None, *, config: DilocoConfig | None = None,
                 quorum: QuorumConfig | None = None, clock: Clock | None = None,
                 on_commit: Callable[[RoundRecord], None] | None = None) -> None:
        """Either a ready `syncer`, or the `config` (and `quorum`) of one made from the first learner's
        parameters."""
        if syncer is None and config is None:
            raise ValueError("InProcessHub needs a syncer, or config= to make one from the first learner")
        self.syncer = syncer
        self.config = syncer.config if syncer is not None else config
        self.quorum = syncer.quorum if syncer is not None else (quorum or QuorumConfig())
        self.clock = clock or MonotonicClock()
        self.round_log: list[RoundRecord] = []
        self._on_commit = on_commit
        self._endpoints: dict[int, tuple[Deliver, GenesisSource | None]] = {}
        self.learners: dict[int, Learner] = {}
        """Learners attached with `join` (the core-level helpers below)."""
        self._lock = threading.RLock()
        """Held by every call into the syncer core, deliveries included (a delivery may send again: reentrant)."""

    # ---- endpoints (ddiloco.session) ---------------------------------------------------------------

    def connect(self, learner_id: int, deliver: Deliver, *, genesis: GenesisSource | None = None) -> None:
        """Route the syncer's messages for `learner_id` to `deliver`; `genesis` is asked for its initial
        parameters if this learner joins a hub that has no syncer yet."""
        self._endpoints[learner_id] = (deliver, genesis)

    def disconnect(self, learner_id: int) -> None:
        self._endpoints.pop(learner_id, None)

    def send(self, message: LearnerMessage) -> None:
        """A learner's message reaches the syncer; its answers are delivered before this returns."""
        with self._lock:
            self._send(message)

    def _send(self, message: LearnerMessage) -> None:
        if self.syncer is None:
            if not isinstance(message, Join):
                return  # nothing can have joined a hub without a syncer
            _, genesis = self._endpoints.get(message.learner_id, (None, None))
            if genesis is None:
                raise JoinRefusedError(f"learner {message.learner_id} joined a hub that has no global model yet "
                                       "and offered no initial parameters")
            params, embeddings = genesis()
            try:
                self.syncer = Syncer(self.config, self.quorum, initial_params=params, embeddings=embeddings)
            except ValueError as exc:
                refused = f"learner {message.learner_id}'s initial parameters were refused: {exc}"
                raise JoinRefusedError(refused) from exc
        self._run(self.syncer.receive(message, self.clock.now()))

    def advance(self) -> None:
        """Let the syncer close rounds whose grace window has ended."""
        with self._lock:
            if self.syncer is not None:
                self._run(self.syncer.advance(self.clock.now()))

    def _run(self, actions: list[SyncerAction]) -> None:
        for action in actions:
            if isinstance(action, Commit):
                self.round_log.append(action.record)
                if self._on_commit is not None:
                    self._on_commit(action.record)
            elif isinstance(action, Send):
                endpoint = self._endpoints.get(action.learner_id)
                if endpoint is not None:
                    endpoint[0](action.message)

    # ---- the trained model ---------------------------------------------------------------------------

    @torch.no_grad()
    def load_global(self, model: nn.Module) -> None:
        """Copy the run's global parameters (the syncer's, after its last committed round) into `model` in place, by
        the plain module's names (a `torch.compile`, DDP or DataParallel wrapper is fine), so tied weights stay one
        tensor: what `ddiloco export` gives a run of processes, for a run in this process. Buffers (BatchNorm's
        statistics) are left as `model` holds them: in process each learner's model keeps its own. ValueError when no
        learner has joined yet, or naming what differs when `model`'s parameters are not the run's."""
        if self.syncer is None:
            raise ValueError("no learner has joined this hub yet: there is no global model to load")
        with self._lock:
            params = self.syncer.global_params()
        own = dict(unwrap(model).named_parameters())
        differ = sorted(set(params) ^ set(own)) or [n for n in sorted(own) if own[n].shape != params[n].shape]
        if differ:
            name = differ[0]
            what = (f"has shape {tuple(own[name].shape)}, the run's {tuple(params[name].shape)}" if name in own
                    and name in params else "is not in the run's model" if name in own else "is missing from it")
            raise ValueError(f"this model's parameters are not the run's: parameter {name!r} {what} "
                             f"({len(differ)} difference{'s' if len(differ) > 1 else ''} in all)")
        for name, parameter in own.items():
            parameter.copy_(params[name])

    # ---- learner cores driven directly (tests, experiments) ------------------------------------------

    def join(self, learner: Learner) -> None:
        """Attach a bare `Learner` core and load the global parameters into it. Raises JoinRefusedError."""
        self.learners[learner.learner_id] = learner

        def deliver(message: SyncerMessage) -> None:
            for reply in learner.receive(message):
                self.send(reply)

        def genesis() -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
            return ({n: p.detach().clone() for n, p in learner.model.named_parameters()},
                    tuple(sorted(learner.embeddings)))

        self.connect(learner.learner_id, deliver, genesis=genesis)
        self.send(learner.join_message())
        if not learner.joined:
            del self.learners[learner.learner_id]
            self.disconnect(learner.learner_id)
            raise JoinRefusedError(learner.refused_reason or "no answer from the syncer")

    def after_inner_step(self, learner: Learner, tokens: int) -> None:
        """Call after each inner step of `learner` (after `optimizer.step()`)."""
        for update in learner.after_inner_step(tokens):
            self.send(update)
        self.advance()

    def leave(self, learner: Learner) -> None:
        self.learners.pop(learner.learner_id, None)
        self.disconnect(learner.learner_id)
        self.send(Leave(learner.learner_id))
