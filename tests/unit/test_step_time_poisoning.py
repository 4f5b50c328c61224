"""The step-time estimate behind every round's grace window is not one learner's to set.

Found by a probe of the real runtime: a joined learner sent two updates the syncer rejected (more tokens than the run
allows), 30 s apart at inner steps 1 and 2. The core still took their spacing as a 30 s step time, every round's grace
window grew to two of those steps, and the honest learners' rounds fell from 20.4 to 0.2 a second for about 40 s.
Here on the syncer core alone, with time passed in: two honest learners publish one inner step every 0.1 s.
"""

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import QuorumConfig
from ddiloco.messages import Join, Rejected, RejectReason, Send, Update
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of, single_fragment

STEP_S = 0.1
"""The honest learners' step time."""
HONEST = (0, 1)
HOSTILE = 2


class Run:
    """A syncer core with three joined learners; the honest ones publish an inner step every STEP_S."""

    def __init__(self) -> None:
        self.config = single_fragment(overlap_steps=3)
        quorum = QuorumConfig(min_quorum=1, grace="adaptive", heartbeat_timeout_s=1000.0)
        self.syncer = Syncer(self.config, quorum, initial_params=params_of(TinyNet(seed=1)))
        for learner_id in (*HONEST, HOSTILE):
            self.syncer.receive(Join(learner_id, self.syncer.spec, self.config.fingerprint()), now=0.0)
        self.now = 0.0
        self.inner_step = 0
        self.sent: dict[int, tuple[int, int]] = {}
        """Per honest learner: (base version, steps) of its last update."""

    def update(self, learner_id: int, *, inner_step: int, steps: int, tokens: int) -> Update:
        codec = get_codec(self.config.codec)
        payload = {spec.name: codec.encode(torch.zeros(spec.shape)) for spec in self.syncer.spec.tensors}
        return Update(learner_id, 0, self.syncer.versions[0], inner_step, steps, tokens, self.config.codec, payload)

    def honest_steps(self, count: int, *, step_s: float = STEP_S) -> None:
        for _ in range(count):
            self.now += step_s
            self.inner_step += 1
            self.syncer.advance(self.now)
            for learner_id in HONEST:
                base, steps = self.sent.get(learner_id, (-1, 0))
                # Work since the learner's base: one more step while its update is still held from that base.
                steps = steps + 1 if base == self.syncer.versions[0] else 1
                self.sent[learner_id] = (self.syncer.versions[0], steps)
                self.syncer.receive(self.update(learner_id, inner_step=self.inner_step, steps=steps, tokens=steps),
                                    self.now)

    def hostile(self, inner_step: int, *, tokens: int = 1) -> list:
        return self.syncer.receive(self.update(HOSTILE, inner_step=inner_step, steps=1, tokens=tokens), self.now)


def rejections(actions: list) -> list[RejectReason]:
    return [a.message.reason for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]


def test_rejected_updates_never_feed_the_step_time():
    run = Run()
    run.honest_steps(10)
    assert run.syncer.step_time.value == pytest.approx(STEP_S)
    over_the_limit = run.syncer.quorum.max_tokens_per_step + 1
    assert rejections(run.hostile(1, tokens=over_the_limit)) == [RejectReason.BAD_COUNTERS]
    run.honest_steps(300)  # 30 s
    assert rejections(run.hostile(2, tokens=over_the_limit)) == [RejectReason.BAD_COUNTERS]
    assert run.syncer.step_time.value == pytest.approx(STEP_S)
    assert run.syncer.grace_window() == pytest.approx(2 * STEP_S)  # the cap, tau - 1 = 2 honest steps


def test_one_learner_cannot_move_the_step_time_by_an_order_of_magnitude():
    run = Run()
    run.honest_steps(10)
    assert not rejections(run.hostile(1))
    run.honest_steps(300)  # 30 s
    assert not rejections(run.hostile(2))  # accepted: 30 s for its one inner step
    assert run.syncer.step_time.value < 10 * STEP_S
    run.honest_steps(20)  # and the honest learners' next updates bring it back
    assert run.syncer.step_time.value == pytest.approx(STEP_S, rel=0.01)


def test_a_slowdown_of_every_learner_is_followed_whole():
    run = Run()
    run.honest_steps(10)
    run.honest_steps(30, step_s=100 * STEP_S)
    assert run.syncer.step_time.value == pytest.approx(100 * STEP_S, rel=1e-3)
