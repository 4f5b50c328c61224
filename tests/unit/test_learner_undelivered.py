"""An update the learner's transport could not deliver (`Undelivered`): the learner stops waiting for its round, and
the work it carried is not lost (`Learner._undelivered`; the process-level fault is in
tests/integration/test_syncer_away.py)."""

from ddiloco.config import QuorumConfig
from ddiloco.messages import FragmentState, Undelivered
from tests.helpers import make_batches, make_system, single_fragment, train_step


def undelivered_setup():
    """A learner (H = 4, tau = 1) whose first update is lost on its way: returned with the system."""
    config = single_fragment(sync_every=4, overlap_steps=1)
    syncer, hub, clock, (learner, other) = make_system(2, config, QuorumConfig(grace="none",
                                                                              heartbeat_timeout_s=1000.0))
    lost = []
    for batch in make_batches(4, seed=1):
        lost += learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
    (update,) = lost
    return syncer, hub, learner, other, update


def test_an_undelivered_update_blocks_nothing():
    _, _, learner, _, update = undelivered_setup()
    learner.after_inner_step(train_step(learner.model, learner.optimizer, make_batches(1, seed=2)[0]))
    assert not learner.can_step  # tau steps after its publish, the result is owed
    learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step))
    assert learner.can_step and learner.stats.waits_abandoned == 0
    # A notice about an older update of the fragment changes nothing.
    learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step - 4))


def test_its_work_precedes_a_newer_version_of_the_fragment():
    syncer, hub, learner, other, update = undelivered_setup()
    learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step))
    steps = learner.inner_step
    # Another learner's round makes version 1: the lost work goes out first, from its base, with every step since.
    for batch in make_batches(4, seed=3):
        hub.after_inner_step(other, train_step(other.model, other.optimizer, batch))
    assert syncer.versions == [1] and learner.versions == [1]
    (held,) = [h for h in syncer.held_updates() if h.learner_id == learner.learner_id]
    assert (held.base_version, held.inner_step) == (0, steps)
    assert learner.stats.updates_published_early == 1


def test_a_welcome_at_its_base_publishes_it_again_at_once():
    syncer, _, learner, _, update = undelivered_setup()
    learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step))
    welcome = [a.message for a in syncer.receive(learner.join_message(), 1.0) if hasattr(a, "message")][0]
    (again,) = learner.receive(welcome)
    assert (again.fragment, again.base_version, again.steps) == (0, 0, 4)
    assert isinstance(welcome.fragments[0], FragmentState)
