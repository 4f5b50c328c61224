"""The global model a watcher (an evaluator) reads counts in `syncer_status.json`'s `bytes_watched`, kept across
restarts. Before, it counted nowhere: an audit's run reported `bytes_sent` 7.7 MB where 13.5 MB left the syncer, the
evaluator's 5.75 MB of watches missing (`bytes_sent` is the learners' payload, docs/runtime.md)."""

from __future__ import annotations

from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Join
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.runtime.syncer_tally import SyncerTally
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, filled_update, params_of

CONFIG = DilocoConfig(num_fragments=2, codec="fp32", sync_every=4)
QUORUM = QuorumConfig(min_quorum=1, grace="none")
RUN = RunConfig(diloco=CONFIG, quorum=QUORUM, num_learners=1)


def test_each_model_a_watcher_is_handed_counts_and_learner_bytes_do_not(tmp_path):
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)))
    model_bytes = sum(p.numel() * 4 for p in TinyNet(seed=100).parameters())
    service = SyncerService(RUN, syncer, SyncerStore(tmp_path), sink=NullSink(), clock=VirtualClock())
    assert not isinstance(service.join(Join(0, syncer.spec, CONFIG.fingerprint()), CONFIG.to_dict(), "test"), str)
    rounds, _ = service.snapshot(-1, 0.0)
    assert service.snapshot(rounds, 0.0) is None  # nothing new: nothing handed, nothing counted
    accepted, reason, _ = service.update(filled_update(syncer, 0, 0, inner_step=4))
    assert accepted, reason
    service.snapshot(rounds, 0.0)
    status = service.status()
    assert status["bytes_watched"] == 2 * model_bytes
    assert status["bytes_sent"] == syncer.bytes_sent  # the learners' (the Welcome, the round's result) only
    assert service.tally.meta(syncer)["bytes_watched"] == 2 * model_bytes  # a full state keeps it


def test_a_restarted_syncer_carries_the_count_on():
    tally = SyncerTally({"bytes_watched": 100}, {}, num_learners=1, refusal_log_period_s=1.0)
    tally.carry_over({"bytes_watched": 250})  # the last status is ahead of the full state
    assert tally.bytes_watched == 250
    tally.carry_over({"bytes_watched": 50})
    assert tally.bytes_watched == 250

