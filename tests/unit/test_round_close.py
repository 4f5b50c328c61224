"""When a round closes as learners come and go (`Syncer._schedule`)."""

from ddiloco.config import DilocoConfig, QuorumConfig
from tests.helpers import make_batches, make_system, train_step

CONFIG = DilocoConfig(num_fragments=1, fragment_strategy="single", sync_every=1, overlap_steps=8, codec="fp32",
                      downlink_codec="fp32")


def _step(hub, learner) -> None:
    batch = make_batches(1, seed=learner.learner_id * 100 + learner.inner_step)[0]
    hub.after_inner_step(learner, train_step(learner.model, learner.optimizer, batch))


def test_a_learner_leaving_after_its_update_does_not_close_a_full_quorum_round_without_the_others():
    # The end of a K = M run: learner 0 publishes its last round and leaves before learner 1, still alive and
    # training, reports to that round. Capping K at the learners alive (1) let learner 0's update close it alone.
    quorum = QuorumConfig(min_quorum=2, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, _, (first, second) = make_system(2, CONFIG, quorum)
    _step(hub, first)
    hub.leave(first)
    assert syncer.rounds_committed == 0
    _step(hub, second)
    assert syncer.rounds_committed == 1
    assert [p.learner_id for p in hub.round_log[-1].participants] == [0, 1]


def test_a_round_whose_other_learners_all_left_closes_with_what_it_holds():
    quorum = QuorumConfig(min_quorum=3, grace="none", heartbeat_timeout_s=100.0)
    syncer, hub, _, (first, second, third) = make_system(3, CONFIG, quorum)
    _step(hub, first)
    hub.leave(second)
    assert syncer.rounds_committed == 0
    hub.leave(third)
    assert syncer.rounds_committed == 1
