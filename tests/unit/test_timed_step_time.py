"""The run's step time, behind every round's grace window, is the one the learners time, their waits for results left
out (`Update.step_time_s`). Until 2026-12-07 the syncer took the spacing of each learner's updates, which those waits
stretch: over a long round trip a learner waits at most publishes, and the step time came out many times the real
one (0.148 s for 3.6 ms steps behind a 0.5 s round trip: tests/integration/test_far_link.py), so every grace window
sat at its cap. The spacing is still the estimate where no step time is given (the virtual-time harness).
"""

import math

import pytest
import torch

import ddiloco
from ddiloco.compression import get_codec
from ddiloco.config import QuorumConfig
from ddiloco.inprocess import InProcessHub
from ddiloco.learner import Learner
from ddiloco.messages import Join, Rejected, RejectReason, Send, Update
from ddiloco.round_timing import MIN_GRACE_S
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of, sgd, single_fragment

STEP_S = 0.01
"""The learners' compute time per inner step."""
WAIT_S = 0.5
"""How long each learner waits for a result after each update (a long round trip)."""
STEPS_PER_UPDATE = 4


def joined_syncer(learners: int, quorum: QuorumConfig | None = None) -> tuple[Syncer, dict]:
    """A syncer core of one fragment (tau = 3) with `learners` joined, and a zero payload for their updates."""
    config = single_fragment(overlap_steps=3)
    syncer = Syncer(config, quorum or QuorumConfig(min_quorum=1, grace="adaptive", heartbeat_timeout_s=1000.0),
                    initial_params=params_of(TinyNet(seed=1)))
    codec = get_codec(config.codec)
    payload = {spec.name: codec.encode(torch.zeros(spec.shape)) for spec in syncer.spec.tensors}
    for learner_id in range(learners):
        syncer.receive(Join(learner_id, syncer.spec, config.fingerprint()), now=0.0)
    return syncer, payload


def run_syncer(step_time_s: float | None) -> Syncer:
    """Two learners publishing every STEPS_PER_UPDATE inner steps of STEP_S, each update followed by a WAIT_S wait;
    each update names `step_time_s` (None: not timed)."""
    syncer, payload = joined_syncer(2)
    now, inner_step = 0.0, 0
    for _ in range(20):
        now += STEPS_PER_UPDATE * STEP_S
        inner_step += STEPS_PER_UPDATE
        for learner_id in (0, 1):
            update = Update(learner_id, 0, syncer.versions[0], inner_step, STEPS_PER_UPDATE, STEPS_PER_UPDATE,
                            syncer.config.codec, payload, step_time_s=step_time_s)
            actions = syncer.receive(update, now)
            assert not [a for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]
        now += WAIT_S
        syncer.advance(now)
    return syncer


def test_the_step_time_the_learners_timed_leaves_their_waits_out():
    timed = run_syncer(STEP_S)
    assert timed.step_time.value == pytest.approx(STEP_S)
    assert timed.grace_window() <= 2 * STEP_S  # the cap: tau - 1 = 2 of the learners' steps
    assert all(info.step_time_s == pytest.approx(STEP_S) for info in timed.learners.values())
    spaced = run_syncer(None)  # not timed: the spacing, waits included
    assert spaced.step_time.value == pytest.approx(STEP_S + WAIT_S / STEPS_PER_UPDATE)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.01])
def test_a_step_time_that_is_no_duration_is_refused(bad):
    syncer, payload = joined_syncer(1, QuorumConfig(min_quorum=1))
    actions = syncer.receive(Update(0, 0, 0, 1, 1, 1, syncer.config.codec, payload, step_time_s=bad), 1.0)
    (rejected,) = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]
    assert rejected.reason == RejectReason.BAD_COUNTERS and "step_time_s" in rejected.detail
    assert syncer.step_time.value is None


def test_a_learners_update_carries_the_mean_time_of_its_steps_since_its_last_update():
    config = single_fragment(sync_every=4, overlap_steps=8)
    model = TinyNet(seed=1)
    learner = Learner(config, learner_id=0, model=model, optimizer=sgd(model))
    hub = InProcessHub(config=config, quorum=QuorumConfig(min_quorum=1))
    hub.join(learner)
    updates = []
    for seconds in (0.1, 0.2, 0.3, 0.2, 0.5, 0.5, 0.5, 0.5):
        for update in learner.after_inner_step(4, seconds=seconds):
            updates.append(update)
            hub.send(update)
        hub.advance()
    assert [u.step_time_s for u in updates] == [pytest.approx(0.2), pytest.approx(0.5)]
    other = TinyNet(seed=1)
    untimed = Learner(config, learner_id=1, model=other, optimizer=sgd(other))
    hub.join(untimed)
    assert [u.step_time_s for _ in range(4) for u in untimed.after_inner_step(4)] == [None]


PATH_S = 0.6
"""What the syncer does not see of a result's way to the learner: upload, download, latency both ways."""


def test_the_grace_window_leaves_room_for_the_path_the_learners_report():
    """Each learner reports, with its next update of a fragment, how long its last one took to come back as the round's
    result (`Update.result_delay_s`); less what the syncer held that update, it is the path the syncer's own sync time
    (handing the result to gRPC) leaves out. Behind a 0.6 s path the overlap (tau = 3 steps of 0.01 s) has no slack
    left: the window is its floor (a quarter step, or `MIN_GRACE_S` where that is longer), not its cap (two steps)."""
    syncer, payload = joined_syncer(1)
    now, inner_step = 0.0, 0
    windows = []
    for _ in range(12):
        now += STEPS_PER_UPDATE * STEP_S
        inner_step += STEPS_PER_UPDATE
        # The round closes at once (its one learner reported); the result reaches the learner PATH_S after its update.
        delay = PATH_S if inner_step > STEPS_PER_UPDATE else None
        update = Update(0, 0, syncer.versions[0], inner_step, STEPS_PER_UPDATE, STEPS_PER_UPDATE,
                        syncer.config.codec, payload, step_time_s=STEP_S, result_delay_s=delay)
        syncer.receive(update, now)
        windows.append(syncer.grace_window())
        now += PATH_S
        syncer.advance(now)
    assert syncer.path_time.value == pytest.approx(PATH_S, rel=0.01)
    assert windows[0] == pytest.approx(2 * STEP_S)  # no path reported yet: the driver's sync time (none here)
    assert windows[-1] == pytest.approx(MIN_GRACE_S)  # the floor: a quarter step is 2.5 ms, MIN_GRACE_S 10 ms


def test_a_result_delay_of_another_base_is_not_taken():
    """A delay names the result its update is based on: an update from any other version (its result was lost, a
    newer one arrived first) gives no sample."""
    syncer, payload = joined_syncer(2)
    syncer.receive(Update(0, 0, 0, 4, 4, 4, syncer.config.codec, payload), 1.0)
    syncer.advance(2.0)
    assert syncer.versions[0] == 1 and syncer.learners[0].held[0][0] == 1
    syncer.receive(Update(1, 0, 1, 4, 4, 4, syncer.config.codec, payload), 3.0)  # learner 1 alone makes version 2
    syncer.advance(4.0)
    # Learner 0 is based on version 2 (it never got version 1: a Welcome brought it 2): its delay is not version 1's.
    syncer.receive(Update(0, 0, 2, 8, 4, 4, syncer.config.codec, payload, result_delay_s=9.0), 5.0)
    assert syncer.versions[0] == 2 and syncer.path_time.value is None and 0 not in syncer.learners[0].held


def test_a_session_reports_the_delay_of_each_result_with_its_next_update():
    """In process, through the hub: the session times each result from its update's publish on its clock."""
    from ddiloco.clock import VirtualClock

    config = single_fragment(sync_every=4, overlap_steps=8)
    clock = VirtualClock()
    hub = InProcessHub(config=config, quorum=QuorumConfig(min_quorum=1, grace="fixed", grace_s=0.5), clock=clock)
    model = TinyNet(seed=1)
    optimizer = sgd(model)
    sent = []
    sync = ddiloco.session(model, optimizer, hub=hub, learner_id=0, inner_steps=12, clock=clock)
    sync.start()
    idle_model = TinyNet(seed=1)  # joined and alive, never training: each round waits its 0.5 s window for it
    idle = ddiloco.session(idle_model, sgd(idle_model), hub=hub, learner_id=1, inner_steps=12, clock=clock)
    idle.start()
    original = sync.messages.send
    sync.messages.send = lambda message: (sent.append(message), original(message))[1]
    try:
        while not sync.done:
            clock.advance_to(clock.now() + 0.1)
            sync.step(tokens=4)
    finally:
        sync.close()
        idle.close()
    delays = [u.result_delay_s for u in sent if isinstance(u, Update) and not u.final]
    assert delays[0] is None and all(d is not None and d >= 0.5 for d in delays[1:]), delays


def test_one_learners_report_cannot_set_the_path_time():
    """Each sample counts within a factor of 32 of the estimate (as a step time does): a learner that reports a delay of
    a million seconds moves it at most d + (1 - d) x 32 = 7.2 times (d = 0.8), and the others' reports take it back."""
    syncer, payload = joined_syncer(2, QuorumConfig(min_quorum=2, grace="adaptive", heartbeat_timeout_s=1000.0))
    now = 0.0
    for round_index in range(30):
        now += 1.0
        for learner_id in (0, 1):
            delay = (1e6 if learner_id == 1 and round_index == 6 else PATH_S) if round_index else None
            syncer.receive(Update(learner_id, 0, syncer.versions[0], 4 * (round_index + 1), 4, 4, syncer.config.codec,
                                  payload, step_time_s=STEP_S, result_delay_s=delay), now)
        if round_index == 6:
            assert syncer.path_time.value <= 7.2 * PATH_S * 1.0001
    assert syncer.path_time.value == pytest.approx(PATH_S, rel=0.1)


def test_each_learners_own_path_and_step_time_are_in_the_syncers_status():
    """Which learner's link is slow: each learner's own moving averages of its path time and step time, beside the
    run's, in `syncer_status.json` (and from there `summary.json`). Learner 1 is 3 s away, learner 0 0.6 s."""
    from ddiloco.runtime.syncer_tally import SyncerTally

    syncer, payload = joined_syncer(2, QuorumConfig(min_quorum=2, grace="adaptive", heartbeat_timeout_s=1000.0))
    now = 0.0
    for round_index in range(30):
        now += 1.0
        for learner_id, path_s in ((0, PATH_S), (1, 3.0)):
            syncer.receive(Update(learner_id, 0, syncer.versions[0], 4 * (round_index + 1), 4, 4, syncer.config.codec,
                                  payload, step_time_s=STEP_S * (learner_id + 1),
                                  result_delay_s=path_s if round_index else None), now)
    tally = SyncerTally({}, {}, num_learners=2, refusal_log_period_s=60.0)
    learners = tally.status(syncer, address="", min_quorum=2, sends_dropped=0)["learners"]
    assert learners["0"]["path_time_s"] == pytest.approx(PATH_S, rel=0.01)
    assert learners["1"]["path_time_s"] == pytest.approx(3.0, rel=0.01)
    assert learners["0"]["step_time_s"] == pytest.approx(STEP_S) and learners["1"]["step_time_s"] == pytest.approx(
        2 * STEP_S)
