"""Rounds made durable before the syncer's state changes, and what the syncer does while they cannot be.

A syncer given a `Journal` (the runtime's round log, `SyncerStore`) hands it each round before changing any state
for it. When the journal cannot write (a full disk), nothing changes: the round's updates are rejected as
`unavailable` (their learners' work goes out again with their next updates, from the same base), and so is every
update that arrives until `STORAGE_RETRY_S` has passed; the next round that closes then tries again, and the first
one that is written ends the outage (`RoundJournal.error`, the syncer's `storage_error`).
"""

from __future__ import annotations

import logging
from typing import Protocol

from ddiloco.messages import RoundRecord

logger = logging.getLogger(__name__)

STORAGE_RETRY_S = 1.0
"""After a round could not be made durable, updates are refused as `unavailable` for this long before the
next round tries the journal again."""


class Journal(Protocol):
    """Where rounds become durable before the syncer's state changes (the runtime's `SyncerStore`)."""

    def commit(self, record: RoundRecord) -> None:
        """Make `record` durable, all or nothing; OSError when it cannot (the round then never happened)."""


class RoundJournal:
    """The syncer's side of its `Journal`: writes, and the outage a failed write starts."""

    def __init__(self, journal: Journal | None = None) -> None:
        self.journal = journal
        """None: rounds are kept in memory only."""
        self.error: str | None = None
        """Why the last round could not be made durable, while the journal fails; None otherwise."""
        self._retry_at = 0.0

    def refusing(self, now: float) -> str | None:
        """Why updates are refused at `now` (an outage within `STORAGE_RETRY_S` of its last failed write), or None."""
        return self.error if now < self._retry_at else None

    def write(self, record: RoundRecord, now: float) -> str | None:
        """Hand `record` to the journal; why it could not be written, or None."""
        if self.journal is None:
            return None
        try:
            self.journal.commit(record)
        except OSError as exc:
            first = self.error is None
            self.error = f"the syncer cannot make round {record.round_index} durable ({exc})"
            self._retry_at = now + STORAGE_RETRY_S
            (logger.error if first else logger.warning)("[syncer] %s: not committed, refusing updates for %.1f s",
                                                        self.error, STORAGE_RETRY_S)
            return f"{self.error}: not committed"
        if self.error is not None:
            logger.warning("[syncer] rounds are durable again (round %d written)", record.round_index)
            self.error = None
        return None
