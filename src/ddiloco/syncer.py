"""The syncer core: global parameters, rounds, quorum and grace, merge and outer step (sans-I/O).

The syncer owns the global value of every fragment, its version and its outer Nesterov state. It is
a pure state machine: the driver passes the current time into `receive(message, now)` and
`advance(now)`, calls `advance` again at `next_deadline()`, and carries out the returned actions in
order (`Commit` makes a round durable and must finish before the `Send`s that follow it).

A round for fragment p collects updates (`ddiloco.open_round`) until the minimum quorum K is present (K is capped
at the learners that can still report: those alive and those gone whose update is in the round, so a quorum larger
than the live learners never deadlocks). It then waits a grace window for stragglers (`ddiloco.round_timing`). A
round also closes at once when every live learner has reported. A live learner that sends no update for
`progress_bound()` seconds (its loop hangs while its heartbeats go on) is stalled: it does not count in either rule
until its next update (`ddiloco.liveness`). Closing merges the updates (token-weighted RDA),
takes the outer step, bumps the version and sends the new fragment to every live learner (with a lossy downlink
codec, its change, from which the syncer's own global value is rebuilt the way learners rebuild it:
`ddiloco.downlink`).

Durability comes first: a syncer given a `Journal` (the runtime's round log) hands it each round before
changing any state for it, and refuses updates for a while when it cannot (`ddiloco.round_journal`). The values and
what an outer step does to them are `ddiloco.global_model`'s.

An update that arrives after its round closed goes into the next round of that fragment, within the rules of
`ddiloco.admission` (which also refuses joins that cannot take part); anything else is rejected with a recorded
reason: every update is merged or rejected.

Paper: Decoupled DiLoCo, arXiv 2604.21428.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ddiloco import liveness
from ddiloco.admission import Admission, LearnerInfo
from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.fragments import FragmentPlan
from ddiloco.global_model import GlobalModel
from ddiloco.kernel_threads import KernelThreads
from ddiloco.messages import (
    Commit,
    FragmentState,
    Heartbeat,
    Join,
    LearnerMessage,
    Leave,
    ModelSpec,
    Refused,
    Rejected,
    RejectReason,
    RoundRecord,
    Send,
    SyncerAction,
    Update,
    Welcome,
)
from ddiloco.open_round import FragmentMerge, OpenRound, PendingUpdate, merge_weight
from ddiloco.outer import OuterOptimizer
from ddiloco.round_journal import Journal, RoundJournal
from ddiloco.round_timing import Ema, bounded_step_time, ema, grace_window, round_margins

logger = logging.getLogger(__name__)

MAX_REJECTION_RECORDS = 1000
"""The newest rejections the core keeps as records (`Syncer.rejections`, about 400 B each), for tests and inspection;
`rejection_counts` counts every one, and a driver's event log holds them all."""


@dataclass(frozen=True)
class HeldUpdate:
    """An accepted update still waiting in an open round (lost if the syncer stops now)."""

    learner_id: int
    fragment: int
    base_version: int
    inner_step: int


@dataclass(frozen=True)
class RejectionRecord:
    time: float
    learner_id: int
    fragment: int
    base_version: int
    reason: RejectReason
    detail: str




class Syncer:
    """The global side of Decoupled DiLoCo. See the module docstring."""

    def __init__(self, config: DilocoConfig, quorum: QuorumConfig, *,
                 initial_params: Mapping[str, torch.Tensor], embeddings: Iterable[str] = (),
                 journal: Journal | None = None) -> None:
        """`initial_params`: the run's genesis (the global model before any round); `embeddings`: which
        of them are embedding tables (merged by plain weighted mean; see `FragmentPlan.for_tensors`);
        `journal`: where each round is made durable before it changes anything (none: kept in memory). A genesis
        holding NaN or Inf values raises ValueError (the wire layer refuses one from a learner the same way)."""
        self.config = config
        self.quorum = quorum
        for name, tensor in initial_params.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"initial parameter {name!r} holds NaN or Inf values")
        self.spec = ModelSpec.from_named_tensors(initial_params.items())
        self.plan = FragmentPlan.for_tensors(initial_params, config, embeddings=embeddings)
        self._admission = Admission(config, quorum, spec=self.spec, plan=self.plan)
        shapes = {name: tuple(t.shape) for name, t in initial_params.items()}
        codec = get_codec(config.codec)
        # The merge's and the close's passes over values run on the process's torch thread count (`--threads`).
        self._threads = KernelThreads()
        self._merges = [FragmentMerge(names, shapes, codec, config.merge, self.plan.embeddings, self._threads)
                        for names in self.plan.fragments]
        self.model = GlobalModel(config, self.plan, initial_params, threads=self._threads)
        self.fragment_shares = self.model.fragment_shares
        """Each fragment's share of the model's values (they sum to 1; all equal for a model without values)."""
        self.rounds_committed = 0
        self._reference: list[float | None] = [None] * self.plan.num_fragments
        """Per fragment, the reference norm from its last committed round (`QuorumConfig.max_norm_ratio`); None until
        its second round, and after a restart."""
        self.capped_updates = 0
        """Updates merged with their norm capped (`QuorumConfig.max_norm_ratio`)."""
        self._open = [self._new_round(p) for p in range(self.plan.num_fragments)]
        self.learners: dict[int, LearnerInfo] = {}
        self.rejections: deque[RejectionRecord] = deque(maxlen=MAX_REJECTION_RECORDS)
        self.rejection_counts: Counter[str] = Counter()
        self.step_time = Ema(quorum.estimate_decay)
        self.quorum_time = Ema(quorum.estimate_decay)
        self.sync_time = Ema(quorum.estimate_decay)
        self.path_time = Ema(quorum.estimate_decay)
        """From a learner's publish to its round's result at the learner, less the time the syncer held the update
        (`_observe_path_time`): where learners report it, the grace window's sync time."""
        self.bytes_received = 0
        self.bytes_sent = 0
        self._journal = RoundJournal(journal)

    # ---- reading state ---------------------------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        """Each fragment's version: the rounds committed of it."""
        return self.model.versions

    @property
    def outer(self) -> OuterOptimizer:
        return self.model.outer

    @property
    def journal(self) -> Journal | None:
        """Where each round is made durable before it changes anything (None: kept in memory)."""
        return self._journal.journal

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        self._journal.journal = journal

    @property
    def storage_error(self) -> str | None:
        """Why the last round could not be made durable, while the journal fails; None otherwise."""
        return self._journal.error

    def global_params(self) -> dict[str, torch.Tensor]:
        """A copy of the whole global model, by parameter name."""
        return self.model.params()

    def fragment_state(self, fragment: int) -> FragmentState:
        return self.model.fragment_state(fragment)

    def held_updates(self) -> list[HeldUpdate]:
        """Updates accepted into rounds that have not closed, by fragment and learner."""
        return [HeldUpdate(learner_id, p, pending.base_version, pending.inner_step)
                for p, open_round in enumerate(self._open)
                for learner_id, pending in sorted(open_round.updates.items())]

    def alive_learners(self) -> list[int]:
        return liveness.alive(self.learners)

    def stalled_learners(self) -> list[int]:
        """Learners alive that have sent no update for `progress_bound()` seconds: rounds do not wait for them."""
        return liveness.stalled(self.learners)

    def effective_quorum(self) -> int:
        return max(1, min(self.quorum.min_quorum, len(liveness.counting(self.learners))))

    def progress_bound(self) -> float | None:
        """Seconds without an update after which a live learner stops counting in the quorum (None: never;
        `ddiloco.liveness.progress_bound`)."""
        return liveness.progress_bound(self.config, self.quorum, step_time_s=self.step_time.value)

    def next_deadline(self) -> float | None:
        """When `advance` must next be called: a grace window ends, a learner may time out or stall."""
        times = [r.close_at for r in self._open if r.close_at is not None]
        times += liveness.deadlines(self.learners, heartbeat_timeout_s=self.quorum.heartbeat_timeout_s,
                                    bound=self.progress_bound())
        return min(times) if times else None

    def paused(self, seconds: float) -> None:
        """The syncer did not run for `seconds`: not its learners' silence (`ddiloco.liveness.pause`). Called by a
        driver that measures it."""
        liveness.pause(self.learners, seconds)

    def observe_sync_time(self, seconds: float) -> None:
        """Drivers report how long a merged fragment took to reach a learner (adaptive grace)."""
        self.sync_time.observe(seconds)

    # ---- events ----------------------------------------------------------------------------------

    def receive(self, message: LearnerMessage, now: float) -> list[SyncerAction]:
        if isinstance(message, Update):
            return self._on_update(message, now)
        if isinstance(message, Heartbeat):
            info = self.learners.get(message.learner_id)
            if info is None or not info.alive:
                return [Send(message.learner_id, Rejected(message.learner_id, -1, -1,
                                                          RejectReason.UNKNOWN_LEARNER, "heartbeat"))]
            info.last_seen = now
            return []
        if isinstance(message, Join):
            return self._on_join(message, now)
        if isinstance(message, Leave):
            return self._mark_gone(message.learner_id, now, "left")
        raise TypeError(f"syncer cannot handle {type(message).__name__}")

    def advance(self, now: float) -> list[SyncerAction]:
        """Time has reached `now`: time out silent learners and close rounds whose grace has ended."""
        actions: list[SyncerAction] = []
        for learner_id in liveness.silent(self.learners, now, self.quorum.heartbeat_timeout_s):
            actions += self._mark_gone(learner_id, now, "heartbeat timeout")
        if liveness.stall(self.learners, now, self.progress_bound()):
            for p in range(self.plan.num_fragments):  # rounds that waited for them may close
                actions += self._schedule(p, now)
        for p, open_round in enumerate(self._open):
            if open_round.close_at is not None and open_round.close_at <= now:
                actions += self._close(p, now)
        return actions

    def _on_join(self, join: Join, now: float) -> list[SyncerAction]:
        refusal = self._admission.join_refusal(join)
        if refusal is not None:
            logger.warning("[syncer] refused learner %d: %s", join.learner_id, refusal)
            return [Send(join.learner_id, Refused(join.learner_id, refusal))]
        info = self.learners.setdefault(join.learner_id, LearnerInfo(alive=True, last_seen=now))
        liveness.joined(info, now)
        info.declared_tokens_per_step = join.max_tokens_per_step
        info.joins += 1
        logger.info("[syncer] learner %d joined (join #%d)", join.learner_id, info.joins)
        states = tuple(self.fragment_state(p) for p in range(self.plan.num_fragments))
        self.bytes_sent += sum(s.payload_bytes for s in states)
        return [Send(join.learner_id, Welcome(join.learner_id, states, self.config.fingerprint()))]

    def _mark_gone(self, learner_id: int, now: float, why: str) -> list[SyncerAction]:
        info = self.learners.get(learner_id)
        if info is None or not info.alive:
            return []
        info.alive = False
        # Leaving on purpose is routine (every learner leaves at the end of a run); silence is not.
        (logger.info if why == "left" else logger.warning)("[syncer] learner %d gone (%s)", learner_id, why)
        # Fewer learners alive can lower the effective quorum of rounds already waiting.
        actions: list[SyncerAction] = []
        for p in range(self.plan.num_fragments):
            actions += self._schedule(p, now)
        return actions

    # ---- updates ---------------------------------------------------------------------------------

    def _reject(self, update: Update, reason: RejectReason, detail: str, now: float) -> list[SyncerAction]:
        record = RejectionRecord(now, update.learner_id, update.fragment, update.base_version, reason, detail)
        self.rejections.append(record)
        self.rejection_counts[str(reason)] += 1
        info = self.learners.get(update.learner_id)
        if info is not None:
            info.rejected += 1
        if 0 <= update.fragment < len(self._open):
            self._open[update.fragment].rejections.append((update.learner_id, str(reason)))
        logger.info("[syncer] rejected update of learner %d for fragment %d: %s (%s)",
                    update.learner_id, update.fragment, reason, detail)
        actions: list[SyncerAction] = [Send(update.learner_id, Rejected(
            update.learner_id, update.fragment, update.base_version, reason, detail, inner_step=update.inner_step))]
        if reason == RejectReason.STALE and info is not None and info.alive:
            # Bring the learner up to date so its next update is not stale too.
            state = self.fragment_state(update.fragment)
            self.bytes_sent += state.payload_bytes
            actions.append(Send(update.learner_id, state))
        return actions

    def _on_update(self, update: Update, now: float) -> list[SyncerAction]:
        self.bytes_received += update.payload_bytes
        info = self.learners.get(update.learner_id)
        refusing = self._journal.refusing(now)
        problem = self._admission.update_problem(update, info, storage_error=refusing, versions=self.versions,
                                                 rounds=self._open)
        if info is not None and info.alive:
            info.last_seen = now
            if problem is not None and problem[0] == RejectReason.UNAVAILABLE:
                liveness.progressed(update.learner_id, info, now)  # the syncer's storage failed, not the learner
        if problem is not None:
            return self._reject(update, *problem, now)
        open_round = self._open[update.fragment]
        decoded = open_round.merge.decode(update)
        if isinstance(decoded, tuple):
            return self._reject(update, *decoded, now)
        assert info is not None  # an update from a learner that has not joined has a problem
        liveness.progressed(update.learner_id, info, now)
        # Only accepted updates are timed, a rejected one does not even start a learner's spacing: every round's grace
        # window is made of this estimate, and two rejected updates 30 s apart stretched everyone's windows to 6.6 s.
        self._observe_step_time(info, update, now)
        self._observe_path_time(info, update)
        pending = PendingUpdate((update.payload,), update.base_version, update.steps, update.tokens,
                                update.inner_step, update.final, arrived_at=now, join=info.joins)
        weight = merge_weight(pending, self.versions[update.fragment], self.quorum.staleness_discount)
        open_round.hold(update.learner_id, pending, decoded, weight)
        if open_round.first_at is None and update.base_version == self.versions[update.fragment] and not update.final:
            open_round.first_at = now  # the quorum time runs from the first update the round is due for
        return self._schedule(update.fragment, now)

    def _observe_step_time(self, info: LearnerInfo, update: Update, now: float) -> None:
        """The step time the learner timed (`Update.step_time_s`), or else the spacing of its accepted updates per inner
        step, into the run's step time (each sample bounded relative to it: `ddiloco.round_timing.bounded_step_time`)
        and the learner's own. The spacing counts the learner's waits for results: from the spacing alone, the run's
        step time behind a round trip of 0.5 s comes out 41 times the learner's and every grace window sits at its cap
        (tests/integration/test_far_link.py)."""
        sample = update.step_time_s or None
        if info.last_update is not None:
            last_at, last_step = info.last_update
            if update.inner_step <= last_step:
                sample = None  # no step since its last update (its last work, one update per fragment)
            elif sample is None and now >= last_at:
                sample = (now - last_at) / (update.inner_step - last_step)
        if sample is not None:
            self.step_time.observe(bounded_step_time(sample, self.step_time.value))
            # The learner's own estimate, unbounded: it only measures the margins its own results report.
            info.step_time_s = ema(info.step_time_s, sample, self.quorum.estimate_decay)
        info.last_update = (now, update.inner_step)

    def _observe_path_time(self, info: LearnerInfo, update: Update) -> None:
        """The path of a round's result that the syncer does not see: the learner's delay from its update to the result
        (`Update.result_delay_s`) less what the syncer held that update, when this update is based on that result. The
        learner's upload, the merge and the download, latency both ways: the driver's sync time (the syncer handing the
        result to gRPC) leaves them out, and timed by it alone, a learner 300 ms from the syncer waits at every publish
        for a window that assumes it has slack (`benchmarks/bench_far_grace.py`)."""
        held = info.held.pop(update.fragment, None)
        if held is None or update.result_delay_s is None or update.base_version != held[0]:
            return
        # Bounded as a step time is, relative to the estimate: one learner's report cannot set every round's window.
        sample = max(0.0, update.result_delay_s - held[1])
        self.path_time.observe(bounded_step_time(sample, self.path_time.value))
        info.path_time_s = ema(info.path_time_s, sample, self.quorum.estimate_decay)  # its own, unbounded

    # ---- rounds ----------------------------------------------------------------------------------

    def grace_window(self) -> float:
        """Seconds to wait for stragglers once the quorum is present, from the current estimates
        (`ddiloco.round_timing.grace_window`): the sync time is the path the learners report where they do
        (`path_time`), else the driver's."""
        sync_time_s = self.path_time.value if self.path_time.value is not None else self.sync_time.value
        return grace_window(self.config, self.quorum, step_time_s=self.step_time.value,
                            quorum_time_s=self.quorum_time.value, sync_time_s=sync_time_s)

    def _joined_since(self, learner_id: int, pending: PendingUpdate) -> bool:
        """Whether the learner is alive and joined again after `pending` arrived."""
        info = self.learners.get(learner_id)
        return info is not None and info.alive and info.joins > pending.join

    def _schedule(self, p: int, now: float) -> list[SyncerAction]:
        open_round = self._open[p]
        if not open_round.updates:
            return []
        # Late updates (from an older version than the fragment's) and a learner's last work before it
        # leaves ride in a round but never make one: a round is an outer step, and it is due when
        # learners report from the current version. A learner that joined again after its last work (a session
        # closed and opened again) has reported: its new session cannot send that work again (refused: the round
        # holds it), and a round that waited for it held every learner up until their max_wait_s.
        alive = liveness.counting(self.learners)  # stalled learners are not waited for
        due = {i for i, u in open_round.updates.items()
               if u.base_version == self.versions[p] and (not u.final or self._joined_since(i, u))}
        # K is capped at who can still report: the learners alive and those gone whose update is here. Not the
        # learners alive alone: a learner leaving after its update would let its update alone close a K = M
        # round that the others, alive, are about to report to.
        quorum = max(1, min(self.quorum.min_quorum, len(alive | due)))
        if open_round.quorum_at is None and len(due) >= quorum:
            open_round.quorum_at = now
            open_round.grace_s = self.grace_window()
            open_round.close_at = now + open_round.grace_s
        finished = {i for i, u in open_round.updates.items() if u.final}
        if (open_round.quorum_at is not None and alive <= due) or (not due and alive <= finished):
            # Everyone alive has reported for this round, or no one alive is left to report (the end of a
            # run: learners leave after their last work): nothing left to wait for.
            open_round.quorum_at = now if open_round.quorum_at is None else open_round.quorum_at
            open_round.close_at = now
        if open_round.close_at is not None and open_round.close_at <= now:
            return self._close(p, now)
        return []

    def _close(self, p: int, now: float) -> list[SyncerAction]:
        open_round = self._open[p]
        version_before = self.versions[p]
        record = open_round.record(fragment=p, version=version_before, round_index=self.rounds_committed, now=now,
                                   quorum=self.quorum, sync_every=self.config.sync_every)
        learner_ids = [q.learner_id for q in record.participants]
        pending = [open_round.updates[i] for i in learner_ids]
        overflow, fused = self.model.check_step(p, record.merged)
        if overflow is not None:
            detail = f"the merged round of fragment {p} would make {overflow} non-finite: not committed"
            logger.error("[syncer] %s (learners %s)", detail, learner_ids)
            return self._discard(p, learner_ids, pending, RejectReason.NON_FINITE, detail, now)
        unwritten = self._journal.write(record, now)
        if unwritten is not None:
            return self._discard(p, learner_ids, pending, RejectReason.UNAVAILABLE, unwritten, now)
        # Durable (or kept in memory): from here on the round changes the syncer's state.
        on_time = tuple(i for i, u in zip(learner_ids, pending, strict=True) if u.base_version == version_before)
        broadcast = dataclasses.replace(self.model.step(p, record.merged, record.version, fused=fused),
                                        on_time=on_time, margins=self._margins(open_round, on_time))
        for i, u in zip(learner_ids, pending, strict=True):
            info = self.learners[i]
            info.merged_base[p] = u.base_version
            if u.base_version == version_before:
                info.held[p] = (record.version, now - u.arrived_at)
            info.accepted += 1
            info.tokens_merged += u.tokens
        if open_round.first_at is not None:
            self.quorum_time.observe(open_round.quorum_at - open_round.first_at)
        self.rounds_committed += 1
        for learner_id, norm in open_round.capped:  # (a round with a cap: a positive one)
            logger.warning("[syncer] round %d of fragment %d: learner %d's update has norm %.3g, %.3g times the "
                           "fragment's previous round: it counts as one of norm %.3g (max_norm_ratio)",
                           record.round_index, p, learner_id, norm,
                           norm / open_round.cap * self.quorum.max_norm_ratio, open_round.cap)
        self.capped_updates += len(open_round.capped)
        # Not from a fragment's first round: it covers the few steps before the schedule's first slot, at the start
        # of the warm-up, and the next round's norms were up to 8.75 times its own (docs/protocol.md). Nor from a round
        # whose updates were all zero: a reference of 0 caps nothing, so one learner's zero update closing a round
        # alone (K = 1) took the cap off the next round, where its values of 1e20 went into the global model.
        if record.version >= 2 and open_round.reference_norm:
            self._reference[p] = open_round.reference_norm
        self._open[p] = self._new_round(p)
        actions: list[SyncerAction] = [Commit(record, capped=tuple(i for i, _ in open_round.capped))]
        for learner_id in self.alive_learners():
            actions.append(Send(learner_id, broadcast))
            self.bytes_sent += broadcast.payload_bytes
        logger.debug("[syncer] round %d: fragment %d -> version %d from learners %s",
                     record.round_index, p, self.versions[p], learner_ids)
        return actions

    def _new_round(self, p: int) -> OpenRound:
        """The next round of fragment `p`, capping each update's tensor norms at `max_norm_ratio` times the
        fragment's reference norms (none without a reference)."""
        ratio, reference = self.quorum.max_norm_ratio, self._reference[p]
        # A reference of 0 (every update of the round was zero: a fragment nobody trained) caps nothing.
        cap = ratio * reference if ratio > 0 and reference else None
        return OpenRound(self._merges[p], cap=cap)

    def _margins(self, open_round: OpenRound, on_time: Sequence[int]) -> tuple[float, ...] | None:
        """For each on-time learner (in `on_time`'s order): how many of its own inner steps were left of the round's
        grace window when its update arrived (`ddiloco.round_timing.round_margins`); None: the learners move on
        lateness alone."""
        arrivals = [(open_round.updates[i].arrived_at, self.learners[i].step_time_s) for i in on_time]
        return round_margins(self.config, step_time_s=self.step_time.value, quorum_at=open_round.quorum_at,
                             grace_s=open_round.grace_s, arrivals=arrivals)

    def _discard(self, p: int, learner_ids: list[int], pending: list[PendingUpdate], reason: RejectReason,
                 detail: str, now: float) -> list[SyncerAction]:
        """A round that cannot be committed (its outer step would not be finite, or it cannot be made durable)
        is not a round: nothing changes, the fragment keeps its version, and each of its updates is rejected
        with the reason."""
        self._open[p] = self._new_round(p)
        actions: list[SyncerAction] = []
        for learner_id, update in zip(learner_ids, pending, strict=True):
            record = RejectionRecord(now, learner_id, p, update.base_version, reason, detail)
            self.rejections.append(record)
            self.rejection_counts[str(reason)] += 1
            self.learners[learner_id].rejected += 1
            actions.append(Send(learner_id, Rejected(learner_id, p, update.base_version, reason, detail,
                                                     inner_step=update.inner_step)))
        return actions

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a restarted syncer needs to continue without losing or repeating a round.
        Open rounds are not kept: their updates are lost, which costs only those learners' work."""
        return {
            "config_fingerprint": self.config.fingerprint(),
            "rounds_committed": self.rounds_committed,
            "merged_base": {i: dict(info.merged_base) for i, info in self.learners.items()},
            **self.model.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        if state["config_fingerprint"] not in self.config.fingerprints():
            raise ValueError(f"checkpoint was written with a different algorithm config (its fingerprint "
                             f"{state['config_fingerprint']}, this config's {self.config.fingerprint()}): the config "
                             "was changed since, or the run was saved by a ddiloco whose algorithm config this one "
                             "cannot reproduce (resume it with the version that started it)")
        self.model.load_state_dict(state)
        self.rounds_committed = int(state["rounds_committed"])
        self._reference = [None] * self.plan.num_fragments
        self._open = [self._new_round(p) for p in range(self.plan.num_fragments)]
        # Learners must join again; remembering what was merged keeps double counting impossible.
        self.learners = {int(i): LearnerInfo(alive=False, last_seen=0.0,
                                             merged_base={int(p): int(v) for p, v in bases.items()})
                         for i, bases in state["merged_base"].items()}

    @torch.no_grad()
    def apply_committed(self, records: Sequence[RoundRecord]) -> None:
        """Re-apply committed rounds from a round log on top of the current state, bit for bit: how
        a restarted syncer catches up from its last full state, and how `replay_rounds` works."""
        for record in records:
            if record.round_index != self.rounds_committed:
                raise ValueError(f"round log has round {record.round_index} where {self.rounds_committed} "
                                 "was expected")
            if record.version != self.versions[record.fragment] + 1:
                raise ValueError(f"round {record.round_index} produced version {record.version} of fragment "
                                 f"{record.fragment}, but the state holds version {self.versions[record.fragment]}")
            self.model.step(record.fragment, record.merged, record.version)
            self.rounds_committed += 1
            for participant in record.participants:
                info = self.learners.setdefault(participant.learner_id, LearnerInfo(alive=False, last_seen=0.0))
                info.merged_base[record.fragment] = participant.base_version


def replay_rounds(config: DilocoConfig, initial_params: Mapping[str, torch.Tensor],
                  records: Sequence[RoundRecord]) -> dict[str, torch.Tensor]:
    """Recompute the global parameters from the initial ones and a round log, bit for bit."""
    syncer = Syncer(config, QuorumConfig(), initial_params=initial_params)
    syncer.apply_committed(records)
    return syncer.global_params()
