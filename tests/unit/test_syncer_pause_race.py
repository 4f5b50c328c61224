"""A syncer stopped (SIGSTOP) longer than the heartbeat timeout does not time its learners out, wherever the stop fell.
Until 2026-12-07 only the timer's wake-up looked for the pause: a stop while the timer thread was advancing the core
went unseen (its next wait was set from the time after the stop), and its next advance timed every learner out (a CI
run of tests/integration/test_syncer_pause.py). Here the service's threads run on a virtual clock, and the stop falls
inside the timer's first advance: the clock jumps 4 s there, past the 1.5 s heartbeat timeout."""

from __future__ import annotations

import threading

from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Join
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of

CONFIG, QUORUM = DilocoConfig(num_fragments=2, codec="fp32"), QuorumConfig(min_quorum=1, heartbeat_timeout_s=1.5)
STOP_S = 4.0


def test_a_stop_while_the_timer_advances_the_core_times_no_learner_out(tmp_path, caplog):
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=1)))
    clock = VirtualClock()
    service = SyncerService(RunConfig(diloco=CONFIG, quorum=QUORUM, num_learners=2), syncer, SyncerStore(tmp_path),
                            sink=NullSink(), clock=clock)
    for learner_id in (0, 1):
        assert not isinstance(service.join(Join(learner_id, syncer.spec, CONFIG.fingerprint()), CONFIG.to_dict(),
                                           "test"), str)
    advance, next_deadline = syncer.advance, syncer.next_deadline
    calls: list[float] = []
    twice = threading.Event()

    def stopped_inside(now: float):
        calls.append(now)
        if len(calls) == 1:  # SIGSTOP after the timer took `now`: the process runs again STOP_S later
            clock.advance_to(now + STOP_S)
        if len(calls) == 2:
            twice.set()
        return advance(now)

    # The first step finds a deadline due (as a round's grace ending would), then the learners' deadlines decide.
    syncer.next_deadline = lambda: 0.0 if not calls else next_deadline()
    syncer.advance = stopped_inside
    caplog.set_level("WARNING")
    service.start("127.0.0.1:0")
    try:
        # After the stop the learners' deadlines (1.5 s after their joins) lie in the past unless the pause counts.
        twice.wait(timeout=3.0)
        assert syncer.learners[0].alive and syncer.learners[1].alive, caplog.text
        assert "paused for 4.0 s" in caplog.text
    finally:
        service.close()
