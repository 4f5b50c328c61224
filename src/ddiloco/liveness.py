"""Which learners the syncer core waits for, and when one stops counting.

A learner is alive from its join until it leaves, its stream ends, or it is silent (no heartbeat, no update) for
`QuorumConfig.heartbeat_timeout_s` (`silent`). A live learner that sends no update for `progress_bound` seconds (its
loop hangs while its heartbeat thread runs) is stalled (`stall`): rounds do not wait for it and it does not count in
the quorum, until its next update (`progressed`). The syncer's own pause (its process stopped, its machine suspended)
is not its learners' silence (`pause`).

Functions over the core's `{learner_id: LearnerInfo}`: the syncer core (`ddiloco.syncer`) keeps the map, the rounds
and the clock, and calls these at its events.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ddiloco.admission import LearnerInfo
from ddiloco.config import DilocoConfig, QuorumConfig

logger = logging.getLogger("ddiloco.syncer")  # the syncer's log: its lines read as the syncer's

Learners = Mapping[int, LearnerInfo]

STALL_PERIODS = 4.0
"""A live learner stops counting in the quorum once it has sent no update for this many sync periods (sync_every x the
run's step time), where that is longer than `QuorumConfig.progress_timeout_s` (`progress_bound`). A learner sends an
update every sync_every / num_fragments inner steps; in the harness's `failures` experiment at full scale the longest
gap between a learner's updates was 1.27 periods (`benchmarks/bench_update_gaps.py`)."""


def progress_bound(config: DilocoConfig, quorum: QuorumConfig, *, step_time_s: float | None) -> float | None:
    """Seconds without an update after which a live learner stops counting in the quorum: the larger of
    `QuorumConfig.progress_timeout_s` and STALL_PERIODS sync periods at the run's step time `step_time_s`. None where
    the bound is off (`progress_timeout_s` 0) or no step time is estimated yet (`step_time_s` None: no learner has
    sent two updates, so no one's pace is known, and a learner's first steps may take long: compilation, a restore)."""
    if not quorum.progress_timeout_s or step_time_s is None:
        return None
    return max(quorum.progress_timeout_s, STALL_PERIODS * config.sync_every * step_time_s)


def alive(learners: Learners) -> list[int]:
    return sorted(i for i, info in learners.items() if info.alive)


def stalled(learners: Learners) -> list[int]:
    """Learners alive that have sent no update for the progress bound: rounds do not wait for them."""
    return sorted(i for i, info in learners.items() if info.alive and info.stalled)


def counting(learners: Learners) -> set[int]:
    """The learners a round waits for: alive and not stalled."""
    return {i for i, info in learners.items() if info.alive and not info.stalled}


def joined(info: LearnerInfo, now: float) -> None:
    """`info`'s learner joined at `now`: alive, heard, progressing."""
    info.alive, info.last_seen, info.last_update = True, now, None
    info.last_progress, info.stalled = now, False


def deadlines(learners: Learners, *, heartbeat_timeout_s: float, bound: float | None) -> list[float]:
    """When each live learner may time out, and each counting one may stall (`bound`: `progress_bound`)."""
    times = [info.last_seen + heartbeat_timeout_s for info in learners.values() if info.alive]
    if bound is not None:
        times += [info.last_progress + bound for info in learners.values() if info.alive and not info.stalled]
    return times


def silent(learners: Learners, now: float, heartbeat_timeout_s: float) -> list[int]:
    """Live learners not heard for `heartbeat_timeout_s` at `now` (>=: advancing exactly at a deadline makes
    progress, no busy loop)."""
    return [i for i, info in sorted(learners.items()) if info.alive and now - info.last_seen >= heartbeat_timeout_s]


def stall(learners: Learners, now: float, bound: float | None) -> list[int]:
    """Mark the live learners without an update for `bound` seconds at `now` stalled; returns them."""
    if bound is None:
        return []
    newly = [i for i, info in sorted(learners.items())
             if info.alive and not info.stalled and now - info.last_progress >= bound]
    for learner_id in newly:
        info = learners[learner_id]
        info.stalled = True
        since = "its last update" if info.last_update is not None else "it joined"
        logger.warning("[syncer] learner %d has sent no update in the %.0f s since %s, though its heartbeats arrive "
                       "(a loop that hangs?): rounds no longer wait for it, until its next update",
                       learner_id, now - info.last_progress, since)
    return newly


def progressed(learner_id: int, info: LearnerInfo, now: float) -> None:
    """`info`'s learner sent an update that counts as progress (accepted, or refused only because the syncer's rounds
    could not be written): it counts in the quorum (again)."""
    info.last_progress = now
    if info.stalled:
        info.stalled = False
        logger.warning("[syncer] learner %d sends updates again: rounds wait for it again", learner_id)


def pause(learners: Learners, seconds: float) -> None:
    """The syncer did not run for `seconds` (its process was stopped or its machine suspended, its thread held off):
    learners could not be heard in that time, so it does not count as their silence (heartbeat timeout, stall).
    Without it every learner was timed out at once after a syncer pause longer than `heartbeat_timeout_s`, its
    in-flight work lost at the re-join."""
    for info in learners.values():
        if info.alive:
            info.last_seen += seconds
            info.last_progress += seconds
