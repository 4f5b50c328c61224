"""A round's result: which learners it merged on time, and how much of the grace window each of them had left."""

import pytest

from ddiloco.config import QuorumConfig
from ddiloco.messages import Commit, FragmentState, Send
from tests.helpers import make_system, single_fragment, train_two_steps


def test_a_round_result_names_the_learners_it_merged_on_time():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, _, _, (fast, slow) = make_system(2, single_fragment(sync_every=2), quorum)

    def broadcasts(actions):
        return [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, FragmentState)]

    (late,) = train_two_steps(slow, 9)                                   # from version 0, still on its way
    (first,) = train_two_steps(fast, 8)
    sent = broadcasts(syncer.receive(first, now=0.1))            # K = 1: closes version 1 alone
    assert [(m.version, m.on_time) for m in sent] == [(1, (0,)), (1, (0,))]
    fast.receive(sent[0])
    syncer.receive(late, now=0.2)                                # after the close: held for the next round
    (second,) = train_two_steps(fast, 7)
    actions = syncer.receive(second, now=0.3)
    # Both merged into version 2, but only the fast learner's update was from version 1: the slow one was late.
    (commit,) = [a for a in actions if isinstance(a, Commit)]
    assert [(q.learner_id, q.staleness) for q in commit.record.participants] == [(0, 0), (1, 1)]
    assert [(m.version, m.on_time) for m in broadcasts(actions)] == [(2, (0,)), (2, (0,))]


@pytest.mark.parametrize(("grace_s", "margins"), [(3.0, (3.0, 2.0)), (1.9, (2.05, 1.3 / 1.125))])
def test_a_round_result_says_how_much_of_the_grace_window_each_on_time_learner_had_left(grace_s, margins):
    # A fixed window from the quorum (K = 1: the first update). Margins are in each learner's own step time,
    # measured between its updates, so the first round, with no step time yet, reports none. A window shorter
    # than round_margin_steps (1.5 here) + 0.5 average steps (1.025 s here: 2.05 s) counts as that long: the
    # learner that made the quorum keeps 2.05 of its steps, the one 0.75 s behind it falls short of 1.5.
    quorum = QuorumConfig(min_quorum=1, grace="fixed", grace_s=grace_s, heartbeat_timeout_s=100.0)
    syncer, _, _, (fast, slow) = make_system(2, single_fragment(sync_every=2, round_margin_steps=1.5), quorum)

    def result_of(actions):
        states = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, FragmentState)]
        state = states[0]
        assert len(states) == 2 and all(s is state for s in states)          # one broadcast, to both
        for learner in (fast, slow):
            learner.receive(state)
        return state

    (update,) = train_two_steps(fast, 8)
    assert not [a for a in syncer.receive(update, now=0.0) if isinstance(a, Commit)]   # window open
    (update,) = train_two_steps(slow, 9)
    first = result_of(syncer.receive(update, now=0.5))       # everyone reported: closes at once
    assert (first.on_time, first.margins) == ((0, 1), None)
    (update,) = train_two_steps(fast, 7)
    syncer.receive(update, now=2.0)                           # 1.0 s per step; window until 2.0 + grace_s
    (update,) = train_two_steps(slow, 6)
    second = result_of(syncer.receive(update, now=2.75))      # 1.125 s per step, arrived 0.75 s later
    assert second.on_time == (0, 1)
    assert second.margins == (None if margins is None else pytest.approx(margins))


def test_a_round_without_a_grace_window_reports_no_margins():
    quorum = QuorumConfig(min_quorum=1, grace="none", heartbeat_timeout_s=100.0)
    syncer, _, _, (learner,) = make_system(1, single_fragment(sync_every=2), quorum)
    for round_index in range(3):
        (update,) = train_two_steps(learner, round_index)
        (state,) = [a.message for a in syncer.receive(update, now=float(round_index))
                    if isinstance(a, Send) and isinstance(a.message, FragmentState)]
        learner.receive(state)
        assert state.on_time == (0,) and state.margins is None
