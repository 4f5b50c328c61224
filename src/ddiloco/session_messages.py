"""A learner session's messages: what it applies of what arrived, what it sends, and how its last work gets out.

`SessionMessages` sits between a `ddiloco.Session` and its transport (`ddiloco.session_transport`). Between two inner
steps it applies what the syncer sent, through the learner's rules (`LearnerRules.receive`), and sends their replies;
it sends the updates the rules publish, over gRPC through the `Publisher` thread that encodes them (an update the
publisher withheld, its pseudo-gradient not finite, is forgotten here, on the training thread), in process straight to
the hub. At the end it makes the learner's last work reach the global model: the final flush, the round results still
owed for fragments trained on after their update (`Learner.owed_work`), and the updates a restarting syncer never got
(`Learner.undelivered_work`), each waited for at most `LearnerConfig.max_wait_s`.

It owns no part of the session's lifecycle (joining, checkpoints, status, the `with` block: `ddiloco.learner_session`
and `ddiloco.session_lifecycle`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ddiloco.clock import Clock
from ddiloco.config import LearnerConfig
from ddiloco.interrupts import StopFlag
from ddiloco.learner import Learner
from ddiloco.learner_rules import LearnerRules
from ddiloco.messages import FragmentDelta, FragmentState, Update
from ddiloco.publisher import Publisher
from ddiloco.session_transport import SessionTransport

logger = logging.getLogger(__name__)


class SessionMessages:
    """One learner session's traffic with its syncer. `publish_off_thread`: encode and send updates on the
    `Publisher` thread (gRPC); otherwise each goes to the transport at once (in process, where delivery stays
    synchronous)."""

    def __init__(self, learner: Learner, rules: LearnerRules, transport: SessionTransport, *, config: LearnerConfig,
                 clock: Clock, stop: StopFlag, publish_off_thread: bool) -> None:
        self.learner = learner
        self.rules = rules
        self.transport = transport
        self.config = config
        self.clock = clock
        self._stop = stop
        self.publisher: Publisher | None = None
        """The thread that takes and encodes pseudo-gradients (`ddiloco.publisher`), from `open()` on, or None."""
        self._publish_off_thread = publish_off_thread
        learner.deferred = publish_off_thread
        self._warned_weightless = False
        """Whether an update that counts no tokens was warned about (`_warn_if_weightless`)."""
        self._published_at: dict[int, tuple[int, float]] = {}
        """fragment -> (base version, clock time) of its last update sent: the delay to its round's result, which the
        fragment's next update reports (`Update.result_delay_s`)."""

    @property
    def learner_id(self) -> int:
        return self.learner.learner_id

    def open(self) -> None:
        """Start the publisher's thread (once), as the session starts: a session made and never entered started it and
        kept it for the life of the process."""
        if self._publish_off_thread and self.publisher is None:
            rules, transport = self.rules, self.transport
            self.publisher = Publisher(transport.send, on_sent=self._count_sent,
                                       on_dropped=lambda update, reason: rules.fate(update, "dropped", reason),
                                       on_withheld=transport.wake)

    # ---- between inner steps ----------------------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        if isinstance(message, Update):
            self._warn_if_weightless(message)
            self._published_at[message.fragment] = (message.base_version, self.clock.now())
        if self.publisher is not None:
            self.publisher.send(message)
        else:
            self.transport.send(message)

    def apply_inbox(self) -> None:
        """Apply what arrived, and send the rules' replies (an update published again after a re-join)."""
        self.take_withheld()
        for arrived_at, message in self.transport.take_ready_at():
            self._time_result(message, self.clock.now() if arrived_at is None else arrived_at)
            for reply in self.rules.receive(message, self.clock.now()):
                self.send(reply)

    def _time_result(self, message: Any, arrived_at: float) -> None:
        """A fragment's next version after the base of its last update sent: the result of that update's round (or of
        the round that closed before it), `arrived_at` - its publish after it (`Learner.result_arrived`)."""
        if not isinstance(message, FragmentState | FragmentDelta):
            return
        published = self._published_at.get(message.fragment)
        if published is not None and message.version == published[0] + 1:
            del self._published_at[message.fragment]
            self.learner.result_arrived(message.fragment, message.version, max(0.0, arrived_at - published[1]))

    def take_withheld(self, *, closing: bool = False) -> None:
        """Updates the publisher withheld (a non-finite pseudo-gradient): the learner forgets them. What failed on its
        thread is raised here, on the training thread (not while `closing`: the session ends anyway)."""
        if self.publisher is None:
            return
        if not closing:
            self.publisher.raise_failure()
        for withheld in self.publisher.take_withheld():
            self.learner.withdraw(withheld.update)
            self.rules.fate(withheld.update, "withheld", f"non-finite pseudo-gradient in {withheld.tensor}")

    def close_publisher(self, timeout_s: float) -> None:
        """Let the publisher's queued updates go to the transport (at most `timeout_s`) and end its thread."""
        if self.publisher is not None and not self.publisher.closed:
            self.publisher.close(timeout_s)

    def _warn_if_weightless(self, update: Update) -> None:
        """Warn, once, when an update counts no tokens: its merge weight is 0, so a loop that passes `tokens=0` at every
        step trained a run whose export was its genesis, with nothing said."""
        if update.tokens > 0 or self._warned_weightless:
            return
        self._warned_weightless = True
        logger.warning("[learner %d | inner %d] its update of fragment %d counts 0 tokens over %d inner steps: the "
                       "merge weights an update by tokens^2 / steps, so this one (and every other that counts none) "
                       "weighs nothing and its training is lost. Pass sync.step(tokens=<tokens or samples in the "
                       "batch>) (said once)", self.learner_id, self.learner.inner_step, update.fragment, update.steps)

    def _count_sent(self, update: Any) -> None:
        self.learner.stats.bytes_sent += update.payload_bytes  # (the publisher's thread: the one that writes it)

    # ---- the last work -----------------------------------------------------------------------------------------------

    def send_last_work(self, *, flush: bool, flush_s: float) -> None:
        """`flush`: publish every fragment's unpublished work (after waiting for the round results still owed) and
        see it delivered; either way the queued updates get `flush_s` to go out."""
        if flush and self.learner.joined:
            # Not the inbox first: a merged fragment waiting there would overwrite the very steps the flush
            # publishes (an update one version stale is still merged, see the syncer's late-update rule).
            for update in self.rules.finish():
                self.send(update)
            if self._await_owed_results():
                for update in self.rules.finish():
                    self.send(update)
            self._deliver_last_work(flush_s)
        if self.publisher is not None:
            self.publisher.close(flush_s)  # the queued updates go to the transport, which flushes them next
            self.take_withheld(closing=True)
        self.transport.flush(flush_s)

    def _await_owed_results(self) -> bool:
        """Wait (at most `LearnerConfig.max_wait_s`, as for a round during training) for the results of the fragments
        whose update still awaits its round while later steps were trained on them (`Learner.owed_work`): applied,
        they keep those steps on top, and the next flush publishes them. Without this a learner's last steps of such
        a fragment (up to `overlap_steps`) never reached the global model: each learner of a run had about one
        period of one fragment fewer merged than it trained. Returns whether there was anything to wait for."""
        owed = set(self.learner.owed_work())
        if not owed:
            return False
        started = time.monotonic()
        deadline = started + self.config.max_wait_s
        while True:
            self.apply_inbox()
            if not owed & set(self.learner.owed_work()) or self._stop.is_set() or not self.transport.connected:
                break
            if not getattr(self.transport, "blocking", True):
                self.transport.wait(0.0)  # in process: a round whose grace ended closes now; nothing else can happen
                self.apply_inbox()
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.transport.wait(remaining)
        left = sorted(owed & set(self.learner.owed_work()))
        (logger.warning if left else logger.info)(
            "[learner %d | inner %d] waited %.2f s for the round results of fragments %s to publish the steps "
            "trained after their updates%s", self.learner_id, self.learner.inner_step, time.monotonic() - started,
            sorted(owed), f": fragments {left} still owed, their last steps are not sent" if left else "")
        return True

    def _deliver_last_work(self, flush_s: float) -> None:
        """Make sure the last updates reached the syncer: one that could not (the syncer restarting, a partition) is
        sent again from the Welcome of the syncer's return (`Learner.receive`), waited for at most
        `LearnerConfig.max_wait_s`. A learner whose budget ended while its syncer restarted exited `done` with every
        last update dropped as `unreachable` within milliseconds (a probe: a quarter of both learners' tokens never
        merged, the run `completed` without a word)."""
        if not getattr(self.transport, "blocking", True):
            return  # in process: delivery is immediate
        started = time.monotonic()
        deadline, said = started + self.config.max_wait_s, False
        while True:
            if self.publisher is not None:
                self.publisher.drain(flush_s)
            self.transport.flush(flush_s)
            sent = self.learner.stats.updates_sent
            self.apply_inbox()  # the notices of updates not delivered; a Welcome publishes their work again
            if self.learner.stats.updates_sent != sent and time.monotonic() < deadline:
                continue  # sent again: delivered (or not) before anything else is decided
            lost = self.learner.undelivered_work()
            if not lost or self._stop.is_set() or time.monotonic() >= deadline:
                break
            if not said:
                said = True
                logger.warning("[learner %d | inner %d] its last work of fragments %s did not reach the syncer: "
                               "waiting up to %.0f s (--max-wait-s) for it to come back", self.learner_id,
                               self.learner.inner_step, lost, self.config.max_wait_s)
            self.transport.wait(max(0.0, deadline - time.monotonic()))
        if lost:
            logger.error("[learner %d | inner %d] its last work of fragments %s never reached the syncer: not in the "
                         "global model", self.learner_id, self.learner.inner_step, lost)
        elif said:
            logger.info("[learner %d | inner %d] its last work reached the syncer after %.1f s", self.learner_id,
                        self.learner.inner_step, time.monotonic() - started)
