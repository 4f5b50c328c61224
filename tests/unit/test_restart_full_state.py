"""A syncer restarted more often than every `full_state_every_rounds` rounds still writes full states on the run's
schedule. Before, a restarted syncer counted the period from its own start (`_rounds_at_save` = the rounds it
restored), so one killed every 25 s never wrote a state after the genesis' and every restart replayed every round
since: a probe measured 0, 16, 50, 109, 202, 292, 353 rounds replayed at successive restarts, the syncer's memory
growing by a fragment per replayed round (344 to 510 MiB), for a 1 B-parameter model at P = 24 167 MB a round."""

from __future__ import annotations

from ddiloco.checkpoint import state_files
from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Join
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
from ddiloco.runtime.syncer_state import STATE_DIR, SyncerStore
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, filled_update, params_of

CONFIG = DilocoConfig(num_fragments=2, fragment_strategy="strided", codec="fp32", sync_every=4)
QUORUM = QuorumConfig(min_quorum=1, grace="none")
RUN = RunConfig(diloco=CONFIG, quorum=QUORUM, num_learners=1)
EVERY = 8


def _fresh() -> Syncer:
    return Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)))


def _serve(run_dir, syncer: Syncer, rounds: int, **restored) -> SyncerService:
    """A syncer process: the service around `syncer`, one learner joined, `rounds` more rounds committed (one
    learner's update is a round at once). Left unclosed, as a kill -9 leaves it (a close writes a full state)."""
    service = SyncerService(RUN, syncer, SyncerStore(run_dir), sink=NullSink(), clock=VirtualClock(),
                            config=SyncerServiceConfig(full_state_every_rounds=EVERY), **restored)
    assert not isinstance(service.join(Join(0, syncer.spec, CONFIG.fingerprint()), CONFIG.to_dict(), "test"), str)
    for _ in range(rounds):
        step = 4 * (1 + syncer.rounds_committed)
        accepted, reason, _ = service.update(filled_update(syncer, 0, syncer.rounds_committed % 2, inner_step=step))
        assert accepted, reason
    return service


def _saved(run_dir) -> list[int]:
    return [serial for serial, _ in state_files(run_dir / STATE_DIR)]


def test_a_syncer_killed_before_its_period_still_writes_the_full_state_the_run_is_due(tmp_path):
    first = _fresh()
    _serve(tmp_path, first, 6)  # killed at round 6: no full state since the start's
    assert _saved(tmp_path) == []

    second = _fresh()
    restored = SyncerStore(tmp_path).restore(second)
    assert (restored.state_rounds, restored.replayed) == (0, 6)
    _serve(tmp_path, second, 3, restored=restored)  # rounds 6, 7, 8: the run's state is due at round 8
    assert _saved(tmp_path) == [EVERY]

    third = _fresh()
    restored = SyncerStore(tmp_path).restore(third)
    assert (restored.state_rounds, restored.replayed) == (EVERY, 1)  # a restart replays the 1 round since, not 9
