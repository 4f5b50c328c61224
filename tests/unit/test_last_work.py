"""A learner's last inner steps reach the global model: at the end of its budget, a fragment whose update still awaits
its round (`Learner.owed_work`) is waited for, its result applied with the steps trained since the update kept on top,
and those steps published with the others (`SessionMessages.send_last_work`). Before, they were dropped: a run's
learners had about one period of one fragment fewer merged than they trained (tokens_merged 4,990 of 5,120 each, 2
learners, P = 2, H = 4, 40 steps). A whole run: tests/integration/test_run.py,
test_short_run_writes_the_run_directory_and_summary."""

from __future__ import annotations

import time

import torch

import ddiloco
from ddiloco.config import DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.messages import FragmentDelta, FragmentState, Undelivered, Update
from ddiloco.run_config import RunConfig
from tests.helpers import TinyNet, make_batches, train_step

CONFIG = DilocoConfig(num_fragments=1, sync_every=4, overlap_steps=3, codec="fp32")
TOKENS = 10


class LateResults:
    """The hub's transport with a network's latency: a round's result reaches the learner only once the session waits
    for messages (as over gRPC), not at once. Records every update sent."""

    blocking = True

    def __init__(self, transport) -> None:
        self.inner = transport
        self.held: list = []
        self.released: list = []
        self.sent: list[Update] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, message) -> None:
        if isinstance(message, Update):
            self.sent.append(message)
        self.inner.send(message)

    def take_ready_at(self):
        ready, self.released = self.released, []
        for arrived in self.inner.take_ready_at():
            (self.held if isinstance(arrived[1], (FragmentState, FragmentDelta)) else ready).append(arrived)
        return ready

    def wait(self, timeout_s) -> None:
        self.inner.wait(timeout_s)
        self.released, self.held = self.released + self.held, []


class SyncerAway(LateResults):
    """The syncer restarts as the learner finishes: its `final` updates are not delivered (`Undelivered`, as
    `LearnerIO` reports an update dropped as unreachable); the syncer is back, and the learner re-joined (the
    receiver thread's Welcome), at the next wait, or never with `back=False`."""

    def __init__(self, transport, *, back: bool = True) -> None:
        super().__init__(transport)
        self.away, self.back, self.dropped = True, back, []

    def send(self, message) -> None:
        if isinstance(message, Update) and message.final and self.away:
            self.dropped.append(message)
            self.released.append((None, Undelivered(message.learner_id, message.fragment, message.base_version,
                                                    message.inner_step)))
            return
        super().send(message)

    def wait(self, timeout_s) -> None:
        if self.dropped and self.away and self.back:
            self.away = False
            self.inner.send(self.inner.learner.join_message())  # the hub answers with a Welcome
        super().wait(timeout_s)


def train(inner_steps: int, *, keep_overlap_work: bool = True, transport=LateResults, max_wait_s: float = 60.0):
    """One learner, one fragment, H = 4, tau = 3, `inner_steps` steps: (its transport, the syncer, the session)."""
    diloco = DilocoConfig(**{**CONFIG.__dict__, "keep_overlap_work": keep_overlap_work})
    syncer_config = QuorumConfig(grace="none", heartbeat_timeout_s=1000.0)
    hub = ddiloco.InProcessHub(config=diloco, quorum=syncer_config)
    model = TinyNet(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = RunConfig(diloco=diloco, quorum=syncer_config, num_learners=1,
                       learner=LearnerConfig(max_wait_s=max_wait_s))
    sync = ddiloco.session(model, optimizer, hub=hub, learner_id=0, config=config, inner_steps=inner_steps)
    transport = transport(sync.transport)
    sync.transport = sync.messages.transport = transport
    with sync:
        for batch in make_batches(inner_steps, seed=1):
            if sync.done:
                break
            train_step(model, optimizer, batch)
            sync.step(TOKENS)
    hub.advance()
    return transport, hub.syncer, sync


def test_the_steps_after_an_update_still_awaiting_its_round_are_published_at_the_end():
    transport, syncer, sync = train(10)  # updates at steps 4 and 8; at the end, 8's result is owed
    assert sum(u.tokens for u in transport.sent) == 10 * TOKENS
    assert [u.inner_step for u in transport.sent] == [4, 8, 10]
    assert transport.sent[-1].final and transport.sent[-1].base_version == 2
    assert syncer.learners[0].tokens_merged == 10 * TOKENS
    assert sync.learner.unpublished() == [0]


def test_without_keep_overlap_work_the_result_would_overwrite_them_so_nothing_waits():
    transport, syncer, _ = train(10, keep_overlap_work=False)
    # The result of step 8's update replaces the fragment, steps 9 and 10 included: no wait, no final update.
    assert [u.inner_step for u in transport.sent] == [4, 8]
    assert syncer.learners[0].tokens_merged == sum(u.tokens for u in transport.sent)


def test_last_work_the_syncer_did_not_get_is_sent_again_when_it_is_back():
    transport, syncer, sync = train(10, transport=SyncerAway)
    assert [u.inner_step for u in transport.dropped] == [10]
    again = [u for u in transport.sent if u.final]
    assert [(u.inner_step, u.tokens) for u in again] == [(10, 2 * TOKENS)]
    assert syncer.learners[0].tokens_merged == 10 * TOKENS


def test_a_syncer_that_does_not_come_back_is_waited_for_at_most_max_wait_s(caplog):
    started = time.monotonic()
    transport, syncer, _ = train(10, transport=lambda t: SyncerAway(t, back=False), max_wait_s=0.5)
    assert 0.5 <= time.monotonic() - started < 10
    assert syncer.learners[0].tokens_merged == 8 * TOKENS
    assert "its last work of fragments [0] never reached the syncer" in caplog.text
