"""Rounds, quorum and grace: when a round closes, whom it waits for, the grace window and its estimates."""

import pytest

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.round_timing import MIN_GRACE_S
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, make_system, params_of, publish, single_fragment


def test_round_closes_on_quorum_merges_inside_grace_and_defers_later_updates():
    quorum = QuorumConfig(min_quorum=2, grace="fixed", grace_s=1.0, heartbeat_timeout_s=100.0)
    syncer, hub, clock, learners = make_system(4, single_fragment(), quorum)
    publish(hub, learners[0], clock, 0.0)
    assert syncer.rounds_committed == 0
    publish(hub, learners[1], clock, 0.5)          # quorum: grace until 1.5
    assert syncer.rounds_committed == 0 and syncer.next_deadline() == 1.5
    publish(hub, learners[2], clock, 1.0)          # inside the grace window
    clock.advance_to(1.5)
    hub.advance()
    (first,) = hub.round_log
    assert [p.learner_id for p in first.participants] == [0, 1, 2]
    assert (first.quorum_at, first.closed_at, first.grace_s) == (0.5, 1.5, 1.0)
    # Learner 3 never reported and was not waited for, yet it holds the new version.
    assert learners[3].versions == [1]
    publish(hub, learners[0], clock, 2.0)
    publish(hub, learners[1], clock, 2.1)
    clock.advance_to(3.1)
    hub.advance()
    assert [p.learner_id for p in hub.round_log[1].participants] == [0, 1]


def test_round_closes_early_once_every_live_learner_has_reported():
    quorum = QuorumConfig(min_quorum=1, grace="fixed", grace_s=5.0, heartbeat_timeout_s=100.0)
    syncer, hub, clock, (first, second) = make_system(2, single_fragment(), quorum)
    publish(hub, first, clock, 1.0)
    assert syncer.rounds_committed == 0 and syncer.next_deadline() == 6.0
    publish(hub, second, clock, 2.0)               # nobody left to wait for: no need for the grace
    assert syncer.rounds_committed == 1 and hub.round_log[0].closed_at == 2.0


def test_a_failed_learner_is_never_waited_for():
    quorum = QuorumConfig(min_quorum=3, grace="none", heartbeat_timeout_s=5.0)
    syncer, hub, clock, learners = make_system(3, single_fragment(), quorum)
    publish(hub, learners[0], clock, 1.0)
    publish(hub, learners[1], clock, 2.0)
    assert syncer.rounds_committed == 0
    # Learner 2 is silent: once its heartbeat times out the effective quorum drops to 2.
    assert syncer.next_deadline() == pytest.approx(5.0)
    clock.advance_to(5.01)
    hub.advance()
    assert syncer.rounds_committed == 1 and syncer.alive_learners() == [0, 1]
    # A learner that says it leaves is not waited for either (learner 0 last spoke at 1.0: 5.9 is
    # inside its heartbeat timeout).
    publish(hub, learners[0], clock, 5.9)
    hub.leave(learners[1])
    assert syncer.rounds_committed == 2


def test_advancing_exactly_at_the_deadline_times_a_silent_learner_out():
    syncer, hub, clock, _ = make_system(2, single_fragment(), QuorumConfig(heartbeat_timeout_s=5.0))
    deadline = syncer.next_deadline()
    clock.advance_to(deadline)
    hub.advance()
    assert syncer.alive_learners() == [] and syncer.next_deadline() is None


def test_quorum_larger_than_the_learners_never_deadlocks():
    quorum = QuorumConfig(min_quorum=8, grace="none")
    syncer, hub, clock, learners = make_system(2, single_fragment(), quorum)
    publish(hub, learners[0], clock, 0.0)
    publish(hub, learners[1], clock, 0.1)
    assert syncer.rounds_committed == 1


def test_adaptive_grace_follows_the_formula():
    config = single_fragment(overlap_steps=2)
    syncer = Syncer(config, QuorumConfig(grace="adaptive", grace_gamma=1.0),
                    initial_params=params_of(TinyNet()))
    assert syncer.grace_window() == 0.0                       # no estimate yet: never delay
    syncer.step_time.value, syncer.quorum_time.value, syncer.sync_time.value = 1.0, 0.3, 0.2
    assert syncer.grace_window() == pytest.approx(1.0)        # clip(2 - 0.3 - 0.2, 0, 1)
    syncer.quorum_time.value = 1.5
    assert syncer.grace_window() == pytest.approx(0.3)        # 2 - 1.5 - 0.2
    syncer.quorum_time.value = 3.0
    assert syncer.grace_window() == pytest.approx(0.25)       # no slack left: the floor, a quarter step
    syncer.quorum = QuorumConfig(grace="adaptive", grace_min_steps=0.0)
    assert syncer.grace_window() == 0.0


def test_the_adaptive_grace_cap_is_grace_max_steps_and_at_most_tau_minus_one_steps():
    def grace(tau, **quorum):
        syncer = Syncer(single_fragment(overlap_steps=tau), QuorumConfig(grace="adaptive", **quorum),
                        initial_params=params_of(TinyNet()))
        syncer.step_time.value, syncer.quorum_time.value, syncer.sync_time.value = 1.0, 0.3, 0.2
        return syncer.grace_window()

    assert QuorumConfig().grace_max_steps == 2.0 and DilocoConfig().overlap_steps == 3
    assert grace(3) == pytest.approx(2.0)                             # the defaults: clip(3 - 0.5, 0, 2)
    assert grace(3, grace_gamma=0.6) == pytest.approx(1.5)            # 0.6 x 2.5, under the cap
    assert grace(8, grace_max_steps=4.5) == pytest.approx(4.5)
    assert grace(3, grace_max_steps=5.0) == pytest.approx(2.0)        # never above tau - 1 steps
    assert grace(2) == pytest.approx(1.0)                             # tau = 2: the paper's one step
    assert grace(1) == pytest.approx(0.5)                             # the slack itself, 1 - 0.5
    assert grace(0) == pytest.approx(0.25)                            # no slack: the floor, a quarter step
    assert grace(0, grace_min_steps=2.0) == pytest.approx(1.0)        # the floor too stays under the cap
    assert grace(3, grace_max_steps=0.0) == 0.0                       # a cap of 0 turns the window off


def test_the_adaptive_window_of_millisecond_steps_still_covers_the_milliseconds_processes_arrive_apart():
    """A model with 1 ms inner steps, learners on shared cores: updates of one inner step arrive milliseconds apart
    (descheduled processes), and the round trip alone (31 ms) used the overlap up. The window was a quarter step,
    0.25 ms: each round closed on its first update, and 4 learners of a 3-16-1 MLP trained to 0.04-1.0 where each
    one's plain loop reaches 0.0001 (docs/results.md, "Defaults and rounds", item 19). Now at least MIN_GRACE_S."""
    def grace(step_time_s, path_s, **quorum):
        quorum_config = QuorumConfig(grace="adaptive", **quorum)
        syncer = Syncer(single_fragment(overlap_steps=3), quorum_config, initial_params=params_of(TinyNet()))
        syncer.step_time.value, syncer.quorum_time.value, syncer.sync_time.value = step_time_s, 0.0, path_s
        return syncer.grace_window()

    assert MIN_GRACE_S == 0.01
    assert grace(0.001, 0.031) == pytest.approx(0.01)    # no slack: the floor, 10 ms, not 0.25 ms
    assert grace(0.001, 0.0) == pytest.approx(0.01)      # slack (3 ms): the cap of two steps, lifted to 10 ms
    assert grace(0.2, 1.0) == pytest.approx(0.05)        # a 0.2 s step: a quarter step, as before
    assert grace(0.2, 0.0) == pytest.approx(0.4)         # and its cap of two steps
    assert grace(0.001, 0.031, grace_min_steps=0.0) == 0.0   # a floor of 0 is none, in seconds too
    assert grace(0.001, 0.0, grace_max_steps=0.0) == 0.0     # a cap of 0 turns the window off


def test_step_time_is_estimated_from_update_arrivals():
    quorum = QuorumConfig(min_quorum=1, grace="adaptive", heartbeat_timeout_s=100.0)
    syncer, hub, clock, (learner,) = make_system(1, single_fragment(), quorum)
    for t in (0.0, 0.5, 1.0, 1.5):
        publish(hub, learner, clock, t)
    assert syncer.step_time.value == pytest.approx(0.5)


@pytest.mark.parametrize(("grace_min_steps", "participants"), [(0.25, [[0], [1], [0, 1], [0, 1], [0, 1]]),
                                                                (0.0, [[0], [1]] * 4)])
def test_without_overlap_updates_a_moment_apart_share_their_round(grace_min_steps, participants):
    # tau = 0: no slack, so the adaptive window is its floor. Two learners 0.05 of a 1 s step apart: with a quarter
    # step of floor every round once the step time is known (from the second update on) merges both; without one,
    # K = 1 closed each round on its first update, and each learner made a round, an outer step, of its own.
    quorum = QuorumConfig(min_quorum=1, grace="adaptive", grace_min_steps=grace_min_steps, heartbeat_timeout_s=100.0)
    _, hub, clock, (first, second) = make_system(2, single_fragment(overlap_steps=0), quorum)
    for t in range(4):
        publish(hub, first, clock, float(t))
        publish(hub, second, clock, t + 0.05)
    clock.advance_to(4.0)
    hub.advance()
    assert [[p.learner_id for p in r.participants] for r in hub.round_log] == participants


def test_the_syncer_s_own_pause_is_not_its_learners_silence():
    # A syncer stopped for 40 s (SIGSTOP, a suspended VM) timed every learner out when it ran again.
    syncer, hub, clock, _ = make_system(2, single_fragment(), QuorumConfig(heartbeat_timeout_s=5.0))
    syncer.paused(40.0)  # its driver measured the pause (the service's timer woke 40 s late)
    clock.advance_to(40.0)
    hub.advance()
    assert syncer.alive_learners() == [0, 1]
    assert syncer.next_deadline() == pytest.approx(45.0)  # their full timeout from the end of the pause
    clock.advance_to(45.0)
    hub.advance()
    assert syncer.alive_learners() == []  # silent after it, they are timed out as before
