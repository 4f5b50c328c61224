"""A standby syncer: a second syncer process that follows the primary's durable state and takes over when
the primary dies (`ddiloco syncer --standby`, `ddiloco run --standby-syncer`).

Who serves a run directory is decided by one lock: the serving syncer holds an exclusive `flock` on
`DIR/syncer.lock` for as long as it lives. The kernel releases it when the process ends, `kill -9`
included, so the lock is both how a standby learns that the primary is gone and why two syncers can never
serve one run directory at once (a second primary is refused with the pid of the first). `flock` is
reliable on a local file system; on a network file system it depends on the server (NFSv4 maps it to byte-
range locks), so keep primary and standby on one host there, or check yours.

While it waits, the standby keeps a syncer core at the primary's last committed round: it loads the genesis
and the latest full state once, then applies each round the primary appends to `rounds.jsonl`, reading the
log from where it stopped (`LogFollower`), through the same `Syncer.apply_committed` a restart uses, so its
state is the primary's bit for bit. A round is in the log before any learner hears of it (the round log is
the syncer's journal), so the standby can neither miss a round a learner holds nor repeat one. When it gets
the lock, it reads the rounds that are left, cuts a torn last line (the primary died mid-append: that round
was never sent), and serves like a restarted syncer whose imports, state loading and replay are already
done. Its cost while waiting: one process with torch imported, and the global model, its outer momentum and
the downlink's residual in memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddiloco.interrupts import StopFlag
from ddiloco.messages import RoundRecord
from ddiloco.round_log import RoundFileRemoved, RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.runtime.process_lock import ProcessLock
from ddiloco.runtime.syncer_state import Restored, SyncerStore, read_genesis
from ddiloco.syncer import Syncer

logger = logging.getLogger(__name__)

LOCK_FILE = "syncer.lock"
FOLLOW_POLL_S = 0.05
"""How often a standby looks for the lock and for new rounds."""


class SyncerLock(ProcessLock):
    """The exclusive lock of the syncer serving a run directory (`DIR/syncer.lock`). Held until the process exits."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(Path(run_dir) / LOCK_FILE)


class LogFollower:
    """The rounds appended to a round log since the last look, read from a byte offset (a long log is not read
    again each time). Only complete lines count: a line still being appended is read the next time."""

    def __init__(self, log: RoundLog) -> None:
        self.log = log
        self._offset = 0
        self._next_round = 0

    def new_records(self, *, after: int) -> list[RoundRecord]:
        """Rounds numbered `after` and up that were not returned before, in order; rounds below `after` (already
        in the state the standby loaded) are skipped. ValueError on a gap or a damaged round, as `RoundLog.records`."""
        records = []
        try:
            file = self.log.path.open("rb")
        except FileNotFoundError:
            return []
        with file:
            file.seek(self._offset)
            for raw in file:  # a line at a time: the first look reads the whole log, gigabytes in a long run
                if not raw.endswith(b"\n"):
                    break  # still being appended
                line = self.log.parse_numbered(raw[:-1], self._next_round)
                self._offset += len(raw)
                self._next_round += 1
                if line["round"] >= after:
                    records.append(self.log.record(line))
        return records


def follow_primary(run_dir: str | Path, run_config: RunConfig, lock: SyncerLock,
                   stop: StopFlag) -> tuple[Syncer | None, Restored] | None:
    """Wait as a standby until the primary is gone (`lock` acquired), following its durable state; then the
    core at the last committed round (None if the run has no genesis yet) and what was restored. None when
    `stop` is set first."""
    store = SyncerStore(run_dir)
    syncer: Syncer | None = None
    restored = Restored()
    follower = LogFollower(store.log)
    logger.warning("[syncer] standby: following %s until its syncer (pid %s) is gone", run_dir, lock.holder())
    while not stop.is_set():
        primary_gone = lock.try_acquire()
        try:
            if syncer is None:
                genesis = read_genesis(run_dir)
                if genesis is not None:
                    syncer = genesis.syncer(run_config.diloco, run_config.quorum)
                    restored = store.restore(syncer, repair=False)  # the primary may be appending: it owns the log
                    logger.warning("[syncer] standby: at round %d (state at %d + %d replayed)",
                                   syncer.rounds_committed, restored.state_rounds, restored.replayed)
            if syncer is not None:
                records = follower.new_records(after=syncer.rounds_committed)
                syncer.apply_committed(records)
                restored.replayed += len(records)
        except RoundFileRemoved:
            if primary_gone:  # nobody removes files any more: they are gone for good
                raise
            # The primary wrote newer full states and removed round files this standby had not read yet (while it
            # loaded an older state, or fell behind): read its newest state again.
            logger.info("[syncer] standby: the primary removed round files not read yet; reading its newest state")
            syncer, restored, follower = None, Restored(), LogFollower(store.log)
            stop.wait(FOLLOW_POLL_S)
            continue
        if primary_gone:
            store.log.repair()  # ours now: a torn last line was never sent to anyone
            logger.warning("[syncer] standby: the primary is gone; taking over at round %d",
                           syncer.rounds_committed if syncer is not None else 0)
            return syncer, restored
        stop.wait(FOLLOW_POLL_S)
    return None
