"""The learner core: one island's side of Decoupled DiLoCo, as a sans-I/O state machine.

It wraps the user's model (and inner optimizer, for checkpoints) and knows nothing of sockets,
threads or wall time. A driver runs the inner steps and moves messages; the core answers:

- `join_message()` / `receive(Welcome)`: a learner trains only after it has loaded the syncer's
  global parameters, so its own random initialisation never becomes global state.
- `after_inner_step(tokens)`: counts inner steps and tokens per fragment and returns the `Update`
  (pseudo-gradient base - local, encoded by the codec) of every round that has fallen due. A learner made
  with `max_tokens_per_step` declares it in its `Join` and refuses a step that counts more (the syncer
  rejects an update with more tokens than steps x the declaration, or than the run's limit without one).
- `receive(FragmentState)`: overwrites that fragment's parameters in place (so the inner optimizer
  state survives) and resets its counters; with `keep_overlap_work`, the steps trained since the fragment was
  published are kept on top of the new value, with their counters (docs/protocol.md). Each result also
  measures the learner's pace against the rounds (`RoundSchedule.round_pace`): with `pace_rounds`, a learner slower
  than the others publishes after fewer of its own inner steps. `receive(FragmentDelta)`: the same with the value
  rebuilt from the change (`ddiloco.downlink.rebuild`); a change this learner cannot rebuild (it holds another
  version, or the checksum disagrees) makes it join again, for the Welcome's full float32 fragments.
- `can_step`: the waiting rule. After publishing fragment p at inner step s, the learner may train
  through inner step s + tau (tau = `overlap_steps`) without news; before going further it must hold
  a version of p newer than the one it published from. Any newer version satisfies the wait, even one
  that does not yet include this learner's update (that update is merged into a later round). The
  driver bounds the wait (`LearnerConfig.max_wait_s`) and then calls `stop_waiting()`; the learner
  trains on and the round's result, when it arrives, still replaces the fragment.

The learner never waits for other learners. Paper: arXiv 2604.21428.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from ddiloco.checks import require_int
from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig
from ddiloco.downlink import rebuild
from ddiloco.fragment_access import FragmentAccess, LocalParameters
from ddiloco.fragments import FragmentPlan
from ddiloco.learner_model import DeclaredModel
from ddiloco.learner_stats import LearnerStats
from ddiloco.local_fragments import LocalFragments
from ddiloco.messages import (
    FragmentDelta,
    FragmentState,
    Heartbeat,
    Join,
    LearnerMessage,
    Refused,
    Rejected,
    RejectReason,
    SyncerMessage,
    Undelivered,
    Update,
    Welcome,
)
from ddiloco.non_finite import forget_non_finite_state, reset_non_finite_statistics
from ddiloco.publisher import DeferredPayload
from ddiloco.round_schedule import RoundSchedule, next_uncommitted_round
from ddiloco.sent_updates import SentUpdates
from ddiloco.training import InnerConfig

logger = logging.getLogger(__name__)

DEFAULT_INNER_LR = InnerConfig().lr
"""AdamW learning rate used when the user passes no optimizer: the run's default inner learning rate."""


class Learner:
    """One learner's protocol state around a user's model. See the module docstring."""

    versions = property(lambda self: self.local.versions, doc="Per fragment, the global version it holds.")
    steps_since = property(lambda self: self.local.steps_since, doc="Per fragment, inner steps not yet published.")
    tokens_since = property(lambda self: self.local.tokens_since, doc="Per fragment, their tokens.")
    synced_at = property(lambda self: self.local.synced_at, doc="Per fragment, the step its unpublished work follows.")

    def __init__(self, config: DilocoConfig, *, learner_id: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, max_tokens_per_step: int = 0,
                 access: FragmentAccess | None = None) -> None:
        """`max_tokens_per_step`: the most tokens (or samples) one inner step counts, declared at join (0: none).
        `access`: how fragments are read and written (default: `LocalParameters`, this process holds them)."""
        if learner_id < 0:
            raise ValueError(f"learner_id={learner_id} is invalid: expected an integer >= 0")
        require_int("max_tokens_per_step", max_tokens_per_step, minimum=0)
        self.max_tokens_per_step = max_tokens_per_step
        self.config = config
        self.learner_id = learner_id
        self.model = model
        self.optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=DEFAULT_INNER_LR)
        self.other_optimizers: tuple[torch.optim.Optimizer, ...] = ()
        """Optimizers besides `optimizer` that train this model (a GAN's second one, kept in the session's `state=`):
        `recover` makes them forget their non-finite state too. Set by the session (`ddiloco.session_setup`)."""
        self.declared = DeclaredModel(model, config.embedding_pattern)
        """The model as this learner declares it at join, and the checks that it still is (`ddiloco.learner_model`)."""
        self._params = self.declared.params
        self.access: FragmentAccess = access or LocalParameters(self._params)
        self.spec, self.embeddings = self.declared.spec, self.declared.embeddings
        self.aliases, self.buffers = self.declared.aliases, self.declared.buffers
        self.plan = FragmentPlan.for_tensors(self._params, config, embeddings=self.embeddings)
        self._codec = get_codec(config.codec)
        num = self.plan.num_fragments
        self.local = LocalFragments(self.plan, self._params, self.access)
        """Its fragments against the global ones: bases, versions, the work since (`ddiloco.local_fragments`)."""
        self.inner_step = 0
        self.schedule = RoundSchedule(config.sync_every, num, pace_rounds=config.pace_rounds)
        """When this learner publishes: the round clock, its phase and pace (`ddiloco.round_schedule`)."""
        self.sent = SentUpdates(num)
        """Its last update of each fragment and what became of it (`ddiloco.sent_updates`)."""
        self.deferred = False
        """Leave the pseudo-gradient and its encoding to a background thread (`ddiloco.publisher`): a publish
        then costs the training thread only the copy of the fragment. Set by drivers that send from one."""
        self._blocked_since_result = False
        self.joined = False
        self.refused_reason: str | None = None
        self.finishing = False
        """Its budget is trained (`flush` ran): an update published again is `final` too."""
        self._waiting_to_publish: set[int] = set()
        """Fragments due while the result for their last update was still owed: published at the first step after it
        arrives (or the learner stops waiting for it)."""
        self.step_time_s: float | None = None
        """Seconds per inner step between its last two updates, as the driver timed them (None: not timed)."""
        self._timed_s, self._timed_steps = 0.0, 0
        self._result_delays: dict[int, tuple[int, float]] = {}
        """fragment -> (version, seconds from its last update to that version's arrival), for its next update."""
        self.stats = LearnerStats()
        self.run_config: dict | None = None
        """The run config this learner's model and data were built from, declared at join (the built-in learner's:
        the syncer refuses settings that differ from its run's); None for a script's model."""

    # ---- joining -------------------------------------------------------------------------------

    def join_message(self) -> Join:
        return Join(self.learner_id, self.spec, self.config.fingerprint(), embeddings=tuple(sorted(self.embeddings)),
                    aliases=self.aliases, max_tokens_per_step=self.max_tokens_per_step, buffers=self.buffers,
                    run_config=self.run_config)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(self.learner_id, self.inner_step)

    @property
    def can_step(self) -> bool:
        """True when the driver may run the next inner step."""
        return self.joined and not self.blocking_fragments()

    def blocking_fragments(self) -> list[int]:
        """Fragments published more than tau inner steps ago whose newer version has not arrived."""
        blocking = self._blocking()
        self._blocked_since_result = self._blocked_since_result or bool(blocking)
        return blocking

    def _blocking(self) -> list[int]:
        return self.sent.blocking(self.inner_step, self.config.overlap_steps)

    def stop_waiting(self) -> list[int]:
        """Give up waiting for the fragments that block; returns them. Called by drivers on timeout."""
        blocked = self.blocking_fragments()
        self.sent.abandon(blocked)
        self.stats.waits_abandoned += len(blocked)
        if blocked:
            logger.warning("[learner %d | inner %d] stopped waiting for fragments %s",
                           self.learner_id, self.inner_step, blocked)
        return blocked

    # ---- messages from the syncer ----------------------------------------------------------------

    def receive(self, message: SyncerMessage) -> list[LearnerMessage]:
        """Apply a message from the syncer; returns messages to send back (possibly none)."""
        if isinstance(message, FragmentState):
            early = self._publish_before(message)
            if early is None:
                self._follow_close(message)
            self._apply(message)
            return [early] if early is not None else []
        if isinstance(message, FragmentDelta):
            return self._apply_delta(message)
        if isinstance(message, Welcome):
            if message.learner_id != self.learner_id:
                raise ValueError(f"Welcome for learner {message.learner_id} delivered to {self.learner_id}")
            replies: list[LearnerMessage] = []
            for state in message.fragments:
                # A fragment still at the version this learner holds is the one its local work continues
                # from (a re-join after a partition or a syncer restart): keep that work.
                if not 0 <= state.version == self.versions[state.fragment]:
                    early = self._send_before_welcome(state)
                    if early is not None:
                        replies.append(early)
                    self._apply(state, force=True)
            for p, sent in self.sent.items():
                if sent.base_version == self.versions[p]:
                    # Published from the version the syncer still has: that update was lost (the syncer
                    # restarted with its round open, or it never arrived). Publish again at once, so a
                    # round that waits for every learner (K = M) does not wait a whole period for it.
                    update = self._publish(p, final=self.finishing)
                    if update is not None:
                        replies.append(update)
            self.sent.keep_after_welcome(self.inner_step, self.versions)
            self.joined = True
            self.stats.joins += 1
            logger.info("[learner %d | inner %d] joined at versions %s (%d update(s) published again)",
                        self.learner_id, self.inner_step, self.versions, len(replies))
            return replies
        if isinstance(message, Undelivered):
            self._undelivered(message)
            return []
        if isinstance(message, Refused):
            self.joined = False
            self.refused_reason = message.reason
            logger.debug("[learner %d] refused by the syncer: %s", self.learner_id, message.reason)
            return []
        if isinstance(message, Rejected):
            reason = str(message.reason)
            self.stats.rejections[reason] = self.stats.rejections.get(reason, 0) + 1
            # bad_counters is this learner's own fault (e.g. more tokens than it may count): say so loudly.
            (logger.warning if message.reason == RejectReason.BAD_COUNTERS else logger.info)(
                "[learner %d | inner %d] update for fragment %d rejected: %s %s",
                self.learner_id, self.inner_step, message.fragment, reason, message.detail)
            # Refused for who sent it (unknown_learner), the work of that update counts as not sent, and the re-join's
            # Welcome publishes it again: forgotten, it would be overwritten by the next version of the fragment (a
            # syncer kill -9 lost a learner 48 inner steps of a fragment).
            self.sent.refused(message.fragment, message.base_version, for_sender_at=message.inner_step
                              if message.reason == RejectReason.UNKNOWN_LEARNER else None)
            if message.reason == RejectReason.UNKNOWN_LEARNER:
                # The syncer forgot us (heartbeat timeout or restart): load its state again.
                self.joined = False
                return [self.join_message()]
            return []
        raise TypeError(f"learner cannot handle {type(message).__name__}")

    def _undelivered(self, message: Undelivered) -> None:
        """The update of `message` never reached the syncer (it was unreachable): waiting for its round's result would
        hold the learner up to `max_wait_s` at each fragment for as long as the syncer is away (4 inner steps in a
        90 s outage). It blocks nothing any more, and its work counts as not sent: a newer version of the fragment is
        preceded by that work (`_publish_before`), the fragment's next publish carries it, and a Welcome at its base
        publishes it again at once."""
        self.sent.undelivered(message.fragment, message.base_version, message.inner_step)

    def _publish_before(self, state: FragmentState) -> Update | None:
        """The round that produced `state` closed before this learner published its part of it (it
        started later, or it is slower). Applying the state would overwrite every step trained since the
        base, so that work is published first, from the base, and the round it was scheduled for is
        skipped: the update is one version late and the syncer folds it into the fragment's next round
        (docs/protocol.md, "Rounds"). Only for the version right after the base (an older base is too far
        behind to be worth sending) and when the work since the base has not gone out yet."""
        if not self.joined or not self._overwrites_unsent_work(state, versions_on=1):
            return None
        update = self._publish(state.fragment)
        if update is None:
            return None
        self.schedule.closed_before_publish(state.fragment, state.version, self.inner_step)
        self.stats.updates_published_early += 1
        return update

    def _send_before_welcome(self, state: FragmentState) -> Update | None:
        """A Welcome past the version of the fragment this learner trained on (rounds committed while it was away)
        overwrites that work: work never sent (its update undelivered, or none published since the base) goes out
        first, late by as many versions, as before a newer `FragmentState` (`_publish_before`); the syncer merges it
        into the fragment's next round, or refuses it as stale beyond `QuorumConfig.max_staleness`. Were that work
        overwritten, a learner cut off from a restarting syncer would lose what it trained meanwhile on every fragment
        that others moved on before it joined again, whether the Welcome is one version on or several (a syncer frozen
        for a minute: the first learner back published its work of the outage and trained on before the others joined; a
        third of one learner's tokens was never merged). Its work ledger records it before the Welcome
        (`LearnerRules.receive`): it was trained on the version this learner held before."""
        if not self._overwrites_unsent_work(state, versions_on=None):
            return None
        update = self._publish(state.fragment, final=self.finishing)
        if update is not None:
            self.stats.updates_published_early += 1
        return update

    def _overwrites_unsent_work(self, state: FragmentState, *, versions_on: int | None) -> bool:
        """Whether applying `state`, `versions_on` versions past the one this learner trained its fragment on (None:
        any number), would overwrite work since that base that has not gone out."""
        p = state.fragment
        return (0 <= p < self.plan.num_fragments and 0 <= self.versions[p] < state.version
                and (versions_on is None or state.version == self.versions[p] + versions_on)
                and self.steps_since[p] > 0 and not self.sent.sent_since(p, self.versions[p]))

    def _follow_close(self, state: FragmentState) -> None:
        """Keep this learner's updates inside the rounds (docs/protocol.md, "Rounds"): the result of the round its last
        update was for moves its schedule as `RoundSchedule.follow_result` says. Not where rounds wait for everyone
        (K = M), and not after a fragment's first round (no grace window yet, see `_publish_before`)."""
        p = state.fragment
        if (not self.schedule.follows_rounds or not self.joined or not 0 <= p < self.plan.num_fragments
                or state.version != self.versions[p] + 1 or state.version < 2):
            return
        outstanding = self.sent.get(p)
        if outstanding is None or outstanding.base_version != self.versions[p]:
            return  # nothing published for this round (or that update was refused)
        named = None if state.on_time is None else self.learner_id in state.on_time
        margin = (state.margins[state.on_time.index(self.learner_id)]
                  if named and state.margins is not None and len(state.margins) == len(state.on_time) else None)
        moves = self.schedule.follow_result(named=named, margins_sent=state.margins is not None, margin=margin,
                                            target=self.config.round_margin_steps, gain=self.config.round_margin_gain,
                                            lead_steps=self.inner_step - outstanding.published_at_step)
        self.stats.phase_moves_late += "late" in moves
        self.stats.phase_moves_margin += "margin" in moves
        self.stats.phase_moves_early += "early" in moves

    @torch.no_grad()
    def _apply_delta(self, delta: FragmentDelta) -> list[LearnerMessage]:
        p = delta.fragment
        if not 0 <= p < self.plan.num_fragments:
            raise ValueError(f"fragment {p} out of range 0..{self.plan.num_fragments - 1}")
        if delta.version <= self.versions[p]:
            self.stats.fragments_ignored_stale += 1
            return []
        if not self.joined:
            return []  # a join is under way: its Welcome brings the fragment whole
        if delta.base_version != self.versions[p]:
            problem = f"it holds version {self.versions[p]}, the change applies to {delta.base_version}"
        else:
            rebuilt = rebuild(delta, self.local.base[p], self.plan.fragments[p],
                              {name: tuple(self._params[name].shape) for name in self.plan.fragments[p]})
            if not isinstance(rebuilt, str):
                state = FragmentState(p, delta.version, rebuilt, delta.on_time, delta.margins)
                early = self._publish_before(state)
                if early is None:
                    self._follow_close(state)
                self._apply(state, payload_bytes=delta.payload_bytes, owned=True)
                return [early] if early is not None else []
            problem = rebuilt
        # Only the full state can bring this fragment back in line: join again (the Welcome keeps the work
        # of fragments still at the syncer's version, like any re-join).
        self.stats.bytes_received += delta.payload_bytes
        self.stats.downlink_resyncs += 1
        self.joined = False
        logger.warning("[learner %d | inner %d] cannot rebuild fragment %d version %d (%s): joining again",
                       self.learner_id, self.inner_step, p, delta.version, problem)
        return [self.join_message()]

    def _apply(self, state: FragmentState, *, force: bool = False, payload_bytes: int | None = None,
               owned: bool = False) -> None:
        """`payload_bytes`: what the message carried, when it was not `state` itself (a rebuilt change); `owned`: its
        tensors are this learner's alone (rebuilt here), kept as the base without a copy."""
        p = state.fragment
        if not 0 <= p < self.plan.num_fragments:
            raise ValueError(f"fragment {p} out of range 0..{self.plan.num_fragments - 1}")
        if not force and state.version <= self.versions[p]:
            self.stats.fragments_ignored_stale += 1
            return
        names = self.plan.fragments[p]
        if set(state.tensors) != set(names):
            raise ValueError(f"fragment {p} state carries the wrong tensors")
        self.declared.check_shapes(names)
        self.declared.check_range(state.tensors)
        if not force:
            self._track_round_clock(self.plan.num_fragments * (state.version - 1) + p)
        self.local.take(p, state.tensors, state.version, self.inner_step,
                        carry=not force and self.config.keep_overlap_work, owned=owned)
        self.stats.bytes_received += state.payload_bytes if payload_bytes is None else payload_bytes
        self.stats.fragments_applied += 1
        self.sent.applied(p, state.version)

    def _track_round_clock(self, round_index: int) -> None:
        """A round's result arrived: the schedule measures this learner's pace against the rounds' clock
        (`RoundSchedule.observe_result`), unless it waited for the syncer since the last result."""
        blocked, self._blocked_since_result = self._blocked_since_result or bool(self._blocking()), False
        self.schedule.observe_result(round_index, self.inner_step, blocked=blocked)

    def take_schedule_position(self, welcome: Welcome) -> None:
        """Move to the global schedule position that `welcome` implies.

        For synchronous DiLoCo (K = M), where every round commits once: round r syncs fragment r mod P
        and produces version r div P + 1, so the oldest round not yet committed is
        min over p of (P x version_p + p); the learner is put one inner step before it falls due, so it
        publishes that round next. A learner back from a crash otherwise publishes its fragments out of
        phase with the others, and the waiting rule deadlocks the round that needs its update until the
        driver's wait bound breaks it. K = 1 does not depend on the phase."""
        self.inner_step = self.schedule.take_position(next_uncommitted_round(welcome))
        self.local.restart_at(self.inner_step)
        logger.info("[learner %d | inner %d] took the global schedule position: round %d next",
                    self.learner_id, self.inner_step, self.schedule.next_round)

    # ---- inner steps -----------------------------------------------------------------------------

    def after_inner_step(self, tokens: int, *, seconds: float | None = None) -> list[Update]:
        """Record one finished inner step of `tokens` tokens, which took `seconds` if the driver timed it (its waits
        for results left out: the next update's `step_time_s`); return the updates now due."""
        if not self.joined:
            raise RuntimeError("inner step before joining: the learner must load the global parameters "
                               "first (see can_step)")
        if tokens < 0:
            raise ValueError(f"tokens={tokens} is invalid: expected >= 0")
        self.check_parameters()
        if self.max_tokens_per_step and tokens > self.max_tokens_per_step:
            raise ValueError(f"tokens={tokens} is more than the max_tokens_per_step={self.max_tokens_per_step} this "
                             "learner declared: declare the largest batch it trains on")
        self.inner_step += 1
        if seconds is not None:
            self._timed_s += seconds
            self._timed_steps += 1
        self.local.count_step(tokens)
        # Where a period is as short as a move of the schedule (H = 1 or 2), one move can make a fragment due twice
        # after the same step: one update carries that work, a second would send the same work again.
        due = dict.fromkeys(r % self.plan.num_fragments for r in self.schedule.due_rounds(self.inner_step))
        due.update(dict.fromkeys(sorted(self._waiting_to_publish)))
        updates = []
        for p in due:
            if self._owed(p):
                # Its last update's result is still owed (tau >= H, or the schedule moved forward). Published again
                # from the same base, the second update is rejected if the first has been merged meanwhile, and the
                # steps between the two are lost: it waits for the result instead.
                self.stats.publishes_waited += p not in self._waiting_to_publish
                self._waiting_to_publish.add(p)
                continue
            self._waiting_to_publish.discard(p)
            update = self._publish(p)
            if update is not None:
                updates.append(update)
        return updates

    def check_parameters(self) -> None:
        """Raise ValueError naming each parameter replaced, added or removed since the learner started
        (`DeclaredModel.check_objects`: identities only, no tensor work)."""
        self.declared.check_objects()

    def result_arrived(self, p: int, version: int, delay_s: float) -> None:
        """Version `version` of fragment `p`, the result of the round of its last update, arrived `delay_s` after that
        update was published (the driver times it): its next update from that version reports the delay."""
        self._result_delays[p] = (version, delay_s)

    def _owed(self, p: int) -> bool:
        """Whether fragment `p`'s last update, published from the version this learner holds, awaits its round."""
        return self.sent.owed(p, self.versions[p])

    @torch.no_grad()
    def _publish(self, p: int, *, final: bool = False) -> Update | None:
        names = self.plan.fragments[p]
        self.declared.check_shapes(names)
        current = self.access.read(p, names)
        encoded = DeferredPayload({name: self.local.base[p][name] for name in names}, current, self._codec,
                                  dtypes={name: self._params[name].dtype for name in names})
        # Deferred, only the copy above is on this thread: the pseudo-gradient and its encoding are on the publisher's.
        payload: Mapping[str, bytes] | None = encoded if self.deferred else encoded.resolve()
        if payload is None:
            self.stats.updates_withheld_non_finite += 1
            logger.error("[learner %d | inner %d] non-finite pseudo-gradient in %s: update withheld",
                         self.learner_id, self.inner_step, encoded.non_finite)
            self.recover()
            return None
        if self._timed_steps:
            self.step_time_s = self._timed_s / self._timed_steps
            self._timed_s, self._timed_steps = 0.0, 0
        delay = self._result_delays.pop(p, None)
        update = Update(self.learner_id, p, self.versions[p], self.inner_step, self.steps_since[p],
                        self.tokens_since[p], self.config.codec, payload, final=final, step_time_s=self.step_time_s,
                        result_delay_s=delay[1] if delay is not None and delay[0] == self.versions[p] else None)
        self.local.published(p, current, self.inner_step, keep_value=self.config.keep_overlap_work)
        self.sent.published(p, self.versions[p], self.inner_step)
        self.stats.updates_sent += 1
        if not self.deferred:
            self.stats.bytes_sent += update.payload_bytes  # deferred: counted once encoded (`Publisher`)
        return update

    def withdraw(self, update: Update) -> None:
        """A deferred update was withheld after all (its pseudo-gradient is not finite): forget that it was
        published, as `_publish` does for one withheld on the spot."""
        p = update.fragment
        self.stats.updates_sent -= 1
        self.stats.updates_withheld_non_finite += 1
        self.sent.withdrawn(p, update.base_version)
        self.local.forget_publish(p)  # nothing of that work went out: none of it is carried as unpublished
        self.recover()

    @torch.no_grad()
    def recover(self) -> None:
        """After a pseudo-gradient that was not finite: the learner's own model is not (a NaN loss, an overflow), and
        its inner optimizer's state with it. Left so, every later step is NaN again and every update withheld: the
        learner would train on for nothing. So each fragment whose values are not finite goes back to the global value
        the learner last received (its work since then is lost: it was NaN), the inner optimizer forgets the state of
        every parameter whose state is not finite (on every rank: `FragmentAccess.forget_non_finite_state`), and
        running statistics that are not finite start again (`reset_running_stats`). The learner then trains on from
        the global model. Does nothing when all is finite (an update withheld earlier, already recovered from)."""
        reset = self.local.reset_non_finite(self.inner_step)
        forgotten = sum(forget_non_finite_state(o) for o in (self.optimizer, *self.other_optimizers))
        forgotten += self.access.forget_non_finite_state()
        restarted = reset_non_finite_statistics(self.model)
        if not (reset or forgotten or restarted):
            return
        self.stats.non_finite_recoveries += 1
        logger.error("[learner %d | inner %d] its model is not finite (a NaN loss, an overflow): fragments %s go back "
                     "to the global value, the inner optimizer forgets the state of %d parameters, %d modules restart "
                     "their running statistics; the work since their last results is lost", self.learner_id,
                     self.inner_step, reset, forgotten, restarted)

    def undelivered_work(self) -> list[int]:
        """Fragments whose last update never reached the syncer (`Undelivered`) and whose work no later update carries:
        a Welcome at their base publishes them again."""
        return self.sent.undelivered_fragments()

    def owed_work(self) -> list[int]:
        """Fragments holding inner steps trained after an update whose round result is still owed. The result keeps
        those steps on top of the new value (`keep_overlap_work`), after which `flush` can publish them; without
        `keep_overlap_work` it overwrites them, and nothing is worth waiting for."""
        if not self.config.keep_overlap_work:
            return []
        unpublished = self.unpublished()
        return [p for p in range(self.plan.num_fragments) if unpublished[p] > 0 and self._owed(p)]

    def unpublished(self) -> list[int]:
        """Per fragment, inner steps trained since it was last published or received."""
        return self.local.unpublished(self.inner_step)

    def flush(self) -> list[Update]:
        """At the end of training: publish every fragment that holds unpublished work and has no update
        still waiting for its round, so the final global model includes this learner's last inner steps.
        Rounds are not advanced: the learner is finishing. A fragment whose update still waits (`owed_work`) is
        published by a second flush, once its result has arrived with those steps kept on top of it."""
        if not self.joined:
            return []
        self.finishing = True
        unpublished = self.unpublished()
        updates = []
        for p in range(self.plan.num_fragments):
            if unpublished[p] > 0 and self.steps_since[p] > 0 and not self._owed(p):
                update = self._publish(p, final=True)
                if update is not None:
                    updates.append(update)
        return updates

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The learner's own progress (not the model): counters, schedule position, optimizer."""
        return {
            "learner_id": self.learner_id,
            "inner_step": self.inner_step,
            "versions": list(self.versions),  # which run's global model it trained on (`LearnerCheckpoint.foreign`)
            **self.schedule.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state["learner_id"] != self.learner_id:
            raise ValueError(f"checkpoint belongs to learner {state['learner_id']}, not {self.learner_id}")
        self.inner_step = int(state["inner_step"])
        self.schedule.load_state_dict(state)
        self.local.restart_at(self.inner_step)
        self.optimizer.load_state_dict(state["optimizer"])

