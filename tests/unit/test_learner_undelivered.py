"""An update the learner's transport could not deliver (`Undelivered`): the learner stops waiting for its round, and
the work it carried is not lost (`Learner._undelivered`; the process-level fault is in
tests/integration/test_syncer_away.py)."""

from ddiloco.checkpoint import read_jsonl
from ddiloco.config import LearnerConfig, QuorumConfig
from ddiloco.learner_rules import LearnerRules
from ddiloco.messages import FragmentState, Rejected, RejectReason, Undelivered
from ddiloco.work_ledger import WorkLedger
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


def test_its_work_precedes_a_welcome_with_a_newer_version_of_the_fragment():
    # The learner is away (its syncer restarted, say) while another's round moves the fragment on: the Welcome of its
    # re-join brings version 1. Applied at once, it overwrote the lost work; the work goes out first, from its base,
    # one version late, and the next round merges it.
    syncer, hub, learner, other, update = undelivered_setup()
    learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step))
    hub.disconnect(learner.learner_id)  # it hears nothing of the round below
    for batch in make_batches(4, seed=3):
        hub.after_inner_step(other, train_step(other.model, other.optimizer, batch))
    assert syncer.versions == [1] and learner.versions == [0]
    welcome = [a.message for a in syncer.receive(learner.join_message(), 1.0) if hasattr(a, "message")][0]
    (first,) = learner.receive(welcome)
    assert (first.fragment, first.base_version, first.steps) == (0, 0, 4) and learner.versions == [1]
    assert [a for a in syncer.receive(first, 1.0) if type(a).__name__ == "Rejected"] == []
    assert [(h.learner_id, h.base_version) for h in syncer.held_updates()] == [(learner.learner_id, 0)]


def test_its_work_precedes_a_welcome_several_versions_past_its_base():
    # A syncer frozen for a minute: the first learner back publishes its work of the outage and trains on, so the
    # others' Welcomes come two or more versions past their bases. Only a Welcome one version on sent the work first;
    # from two on it overwrote it (a probe: 38 % of one learner's tokens never merged, the run "completed"). The work
    # goes out; the syncer takes it as far back as `max_staleness` allows and refuses it, saying so, beyond.
    for rounds, fate in ((3, "held"), (6, "stale")):
        syncer, hub, learner, other, update = undelivered_setup()
        learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step))
        hub.disconnect(learner.learner_id)
        for batch in make_batches(4 * rounds, seed=3):
            hub.after_inner_step(other, train_step(other.model, other.optimizer, batch))
        assert syncer.versions == [rounds] and learner.versions == [0]
        welcome = [a.message for a in syncer.receive(learner.join_message(), 1.0) if hasattr(a, "message")][0]
        (first,) = learner.receive(welcome)
        assert (first.fragment, first.base_version, first.steps) == (0, 0, 4) and learner.versions == [rounds]
        rejected = [a.message for a in syncer.receive(first, 1.0) if type(a.message).__name__ == "Rejected"]
        if fate == "held":
            assert rejected == [] and [h.base_version for h in syncer.held_updates()] == [0]
        else:  # beyond max_staleness (4): refused for it, in the learner's counts
            assert [r.reason for r in rejected] == [RejectReason.STALE]


def test_its_ledger_line_precedes_the_welcome(tmp_path):
    # The work ledger says what the chaos invariant `no_fresh_learner_became_global_source` checks: every publish is on
    # a base at least its latest Welcome's. Work trained before this Welcome, on the version held before it, is
    # recorded before the Welcome's line (after it, the invariant read it as a publish on a base older than the
    # Welcome: `ddiloco chaos --quick` found 12 such in the decoupled system), and the Welcome throws none of it away.
    syncer, hub, learner, other, update = undelivered_setup()
    ledger = WorkLedger(tmp_path / "work.jsonl", num_fragments=1, inner_step=learner.inner_step)
    rules = LearnerRules(learner, LearnerConfig(), synchronous=False, events=ledger)
    rules.welcomes = 1  # joined before, in this process
    learner.receive(Undelivered(learner.learner_id, update.fragment, update.base_version, update.inner_step))
    hub.disconnect(learner.learner_id)
    for batch in make_batches(4, seed=3):
        hub.after_inner_step(other, train_step(other.model, other.optimizer, batch))
    welcome = [a.message for a in syncer.receive(learner.join_message(), 1.0) if hasattr(a, "message")][0]
    (first,) = rules.receive(welcome, 1.0)
    ledger.close()
    lines = read_jsonl(tmp_path / "work.jsonl")
    assert [(e["event"], e.get("base_version")) for e in lines] == [("publish", 0), ("welcome", None)]
    assert lines[1]["versions"] == [1] and lines[1]["unpublished"] == [0]
    assert first.base_version == 0 and learner.versions == [1]


def forgotten_setup():
    """`undelivered_setup`, but the update reached a syncer that no longer knew the learner (it restarted, or timed the
    learner out): rejected `unknown_learner`, which asks the learner to join again."""
    syncer, hub, learner, other, update = undelivered_setup()
    (join,) = learner.receive(Rejected(learner.learner_id, update.fragment, update.base_version,
                                       RejectReason.UNKNOWN_LEARNER, inner_step=update.inner_step))
    assert not learner.joined
    return syncer, hub, learner, other, update, join


def test_an_update_of_a_learner_the_syncer_forgot_is_published_again_at_the_welcome():
    # Its work was refused for who sent it, not for what it carries. Before, the learner forgot the update: a Welcome
    # at its base published nothing, and the fragment's next version overwrote the work (a syncer kill -9 in a real
    # run: a learner's 48 inner steps of a fragment lost).
    syncer, _, learner, _, update, join = forgotten_setup()
    welcome = [a.message for a in syncer.receive(join, 1.0) if hasattr(a, "message")][0]
    (again,) = learner.receive(welcome)
    assert (again.fragment, again.base_version, again.steps) == (0, 0, 4)


def test_an_update_of_a_learner_the_syncer_forgot_precedes_a_newer_version_of_the_fragment():
    syncer, hub, learner, other, update, join = forgotten_setup()
    hub.disconnect(learner.learner_id)
    for batch in make_batches(4, seed=3):
        hub.after_inner_step(other, train_step(other.model, other.optimizer, batch))
    assert syncer.versions == [1] and learner.versions == [0]
    welcome = [a.message for a in syncer.receive(join, 1.0) if hasattr(a, "message")][0]
    (first,) = learner.receive(welcome)
    assert (first.fragment, first.base_version, first.steps) == (0, 0, 4) and learner.versions == [1]


def test_an_update_rejected_for_what_it_carries_is_not_sent_again():
    syncer, _, learner, _, update = undelivered_setup()
    learner.receive(Rejected(learner.learner_id, update.fragment, update.base_version, RejectReason.STALE))
    welcome = [a.message for a in syncer.receive(learner.join_message(), 1.0) if hasattr(a, "message")][0]
    assert learner.receive(welcome) == []


def test_the_refusal_of_an_older_update_of_the_same_base_does_not_send_the_later_ones_work_again():
    # The refusal names the update by its inner step: one for an update the learner published before its latest of the
    # same base (the later one was accepted meanwhile) marked the later one as never sent, and the re-join published
    # its work a second time (tests/integration/test_chaos_injectors.py: accepted, then rejected as stale).
    syncer, _, learner, _, update = undelivered_setup()
    later = []
    for batch in make_batches(4, seed=2):
        if not learner.can_step:
            learner.stop_waiting()  # the round of the first update never comes: the learner trains on
        later += learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
    (second,) = later
    assert (second.base_version, second.inner_step) == (update.base_version, 8)
    learner.receive(Rejected(learner.learner_id, update.fragment, update.base_version, RejectReason.UNKNOWN_LEARNER,
                             inner_step=update.inner_step))
    welcome = [a.message for a in syncer.receive(learner.join_message(), 1.0) if hasattr(a, "message")][0]
    assert learner.receive(welcome) == [] and learner.undelivered_work() == []
