"""`SentUpdates`: a learner's last update of each fragment and what became of it (the rules the learner core's tests
exercise through messages: tests/unit/test_learner_undelivered.py)."""

from ddiloco.sent_updates import SentUpdates


def test_a_published_update_is_owed_until_a_newer_version_arrives():
    sent = SentUpdates(2)
    sent.published(0, base_version=3, inner_step=16)
    assert sent.owed(0, 3) and not sent.owed(0, 4) and not sent.owed(1, 3)
    assert sent.blocking(inner_step=18, overlap_steps=3) == [] and sent.blocking(19, 3) == [0]
    assert sent.sent_since(0, 3)
    sent.applied(0, 3)  # not newer than the base: still owed
    assert sent.owed(0, 3)
    sent.applied(0, 4)
    assert 0 not in sent and sent.blocking(40, 3) == []


def test_an_undelivered_update_blocks_nothing_and_its_work_counts_as_not_sent():
    sent = SentUpdates(1)
    sent.published(0, 3, 16)
    sent.undelivered(0, 3, inner_step=12)  # an older update's notice: nothing changes
    assert sent.owed(0, 3) and sent.undelivered_fragments() == []
    sent.undelivered(0, 3, inner_step=16)
    assert not sent.owed(0, 3) and sent.blocking(40, 3) == [] and sent.undelivered_fragments() == [0]
    assert not sent.sent_since(0, 3)


def test_a_refusal_for_the_sender_of_the_last_update_is_an_undelivered_one_any_other_ends_the_wait():
    sent = SentUpdates(1)
    sent.published(0, 3, 16)
    sent.refused(0, 3, for_sender_at=12)  # an older update of the same base: the later one no longer awaited
    assert 0 not in sent and sent.sent_since(0, 3)
    sent.published(0, 3, 20)
    sent.refused(0, 3, for_sender_at=20)
    assert sent.undelivered_fragments() == [0] and not sent.sent_since(0, 3)
    sent.published(0, 4, 24)
    sent.refused(0, 3)  # another base's refusal: nothing changes
    assert sent.owed(0, 4)
    sent.refused(0, 4)
    assert 0 not in sent and sent.sent_since(0, 4)


def test_a_withdrawn_update_is_as_if_never_published_and_a_welcome_keeps_only_what_it_just_sent():
    sent = SentUpdates(2)
    sent.published(0, 3, 16)
    sent.withdrawn(0, 3)
    assert 0 not in sent and not sent.sent_since(0, 3)
    sent.published(0, 3, 20)
    sent.published(1, 2, 24)
    sent.keep_after_welcome(inner_step=24, versions=[3, 2])
    assert [p for p, _ in sent.items()] == [1]
    sent.abandon([1])
    assert sent.items() == []
