"""The syncer service's rule against a second live process of one learner id (`duplicate_process`).

Found by a probe of the real runtime: with learner 0 running, a join as learner 0 naming a process of its own was
refused ("learner 0 is already connected ... (stop one)"), but the same join without `ddiloco-session` metadata was
taken: it replaced the running learner's subscription, silently, and a client joining that way in a loop made the real
learner rejoin every time. Every ddiloco client names its process (`SyncerClient.session`).
"""

import pytest

from ddiloco.clock import VirtualClock
from ddiloco.config import QuorumConfig
from ddiloco.messages import Join
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_admission import MIN_DUPLICATE_WINDOW_S, duplicate_process
from ddiloco.syncer import Syncer
from ddiloco.transport.subscription import Subscription
from tests.helpers import TinyNet, params_of, single_fragment

RUNNING = "hostA/111/aaaa"
"""The session of the process that holds learner 0."""


@pytest.fixture
def held():
    """(run config, syncer core, clock, learner 0's subscription): learner 0 joined at time 10 from RUNNING."""
    config = single_fragment()
    run_config = RunConfig(diloco=config, quorum=QuorumConfig(heartbeat_timeout_s=60.0), num_learners=2)
    syncer = Syncer(config, run_config.quorum, initial_params=params_of(TinyNet(seed=1)))
    clock = VirtualClock(10.0)
    syncer.receive(Join(0, syncer.spec, config.fingerprint()), now=clock.now())
    return run_config, syncer, clock, Subscription(0, session=RUNNING, peer="ipv4:10.0.0.1:5000", since=clock.now())


def refusal(held, session: str, *, at: float, subscribed: bool = True) -> str | None:
    run_config, syncer, clock, subscription = held
    clock.advance_to(at)
    return duplicate_process(run_config, syncer, 0, session, old=subscription if subscribed else None, clock=clock)


@pytest.mark.parametrize("session", ["hostB/222/bbbb", ""])
def test_a_join_while_another_process_is_alive_is_refused_naming_it(held, session):
    reason = refusal(held, session, at=11.0)
    assert reason is not None and reason.startswith("learner 0 is already connected: process hostA/111 from "
                                                    "ipv4:10.0.0.1:5000")


def test_a_join_without_a_session_is_told_why_it_cannot_be_the_running_process(held):
    assert "no ddiloco-session metadata" in refusal(held, "", at=11.0)


def test_the_running_process_may_join_again(held):
    assert refusal(held, RUNNING, at=11.0) is None


@pytest.mark.parametrize("session", ["hostB/222/bbbb", ""])
def test_a_process_that_died_or_fell_silent_is_replaced(held, session):
    # Its stream ended (a kill -9 closes the connection) ...
    assert refusal(held, session, at=11.0, subscribed=False) is None
    # ... or it has not been heard from within two heartbeat periods (a crashed machine, its connection half open).
    window_s = max(MIN_DUPLICATE_WINDOW_S, 2 * held[0].learner.heartbeat_every_s)
    assert refusal(held, session, at=10.0 + window_s - 0.1) is not None
    assert refusal(held, session, at=10.0 + window_s) is None


def test_a_subscription_without_a_session_cannot_be_told_apart_and_is_replaced(held):
    run_config, syncer, clock, _ = held
    anonymous = Subscription(0, peer="ipv4:10.0.0.1:5000", since=clock.now())
    assert duplicate_process(run_config, syncer, 0, RUNNING, old=anonymous, clock=clock) is None
