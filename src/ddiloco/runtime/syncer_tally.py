"""What the syncer service counts and reports besides its Syncer core: counters, status document, round metrics.

`SyncerTally` owns the counters that are saved with each full state (`meta`) and so survive a restart: refusals by
reason, refusals and joins per learner, the bytes moved before this process; each learner's accepted updates and
merged tokens, rebuilt from the round log (`SyncerStore.participation`); and the `Throttle` that decides which
refused calls are logged in full. `SyncerTally.status` is the `syncer_status.json` document; `round_metrics` the
metrics of a committed round. It does no I/O and takes no lock: the service (`syncer_service`) calls it with
its lock held, and logs, writes events and writes the status file itself.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ddiloco.messages import RoundRecord
from ddiloco.runtime.syncer_state import merged_tokens
from ddiloco.syncer import Syncer
from ddiloco.throttle import Throttle

MAX_REFUSING_PEERS = 1024
"""(reason, peer host) pairs whose refusals are summed up separately in one period; the refusals of any more share
one summary (`OTHER_REFUSALS`), so a flood from many addresses is bounded too."""
OTHER_REFUSALS = ("various", "other peers")


def round_metrics(record: RoundRecord) -> dict[str, float]:
    """The metrics the service logs for a committed round, at step `record.round_index + 1` (the rounds committed with
    it, as the evaluator's steps count)."""
    staleness = max(p.staleness for p in record.participants)
    return {
        "syncer/rounds_committed": record.round_index + 1,
        f"syncer/fragment/{record.fragment}/version": record.version,
        f"syncer/fragment/{record.fragment}/staleness": staleness,
        "syncer/participants": len(record.participants),
        "syncer/grace_s": record.grace_s,
        "syncer/quorum_wait_s": record.quorum_at - record.opened_at,
    }


class SyncerTally:
    """The service's counters, restored from a full state's `meta` and the round log's participation."""

    def __init__(self, meta: Mapping[str, Any], participation: dict[int, dict[str, float]], *, num_learners: int,
                 refusal_log_period_s: float) -> None:
        self.num_learners = num_learners
        self.rejections: Counter[str] = Counter(meta.get("rejections", {}))
        self.rejected = Counter({int(k): v for k, v in meta.get("rejected", {}).items()})
        self.joins = Counter({int(k): v for k, v in meta.get("joins", {}).items()})
        self.capped = Counter({int(k): v for k, v in meta.get("capped", {}).items()})
        """Per learner, its updates that counted with a smaller norm (`Commit.capped`)."""
        self.refusals = Throttle(refusal_log_period_s, max_keys=MAX_REFUSING_PEERS, overflow_key=OTHER_REFUSALS)
        self.bytes_base = (int(meta.get("bytes_received", 0)), int(meta.get("bytes_sent", 0)))
        self.bytes_watched = int(meta.get("bytes_watched", 0))
        """The global model's payload handed to watchers (an evaluator's `Watch`), every restart's: not learner traffic,
        so not in `bytes_sent` (an audit found a run's `bytes_sent` 43 % short of what left the syncer)."""
        self.participation = participation

    def carry_over(self, status: Mapping[str, Any]) -> None:
        """Take the counters of the last `syncer_status.json` the run's previous syncer process wrote, where they are
        ahead of the full state's `meta`: that is saved every few rounds, the status every second, so a syncer killed
        (or taken over by its standby) between two full states lost the joins, refusals and bytes since the last one
        (a learner that had joined three times showed `joins: 0`). Every counter only grows, so the larger holds."""
        for reason, count in _counts(status.get("rejections")).items():
            if count > self.rejections[reason]:
                self.rejections[reason] = count
        learners = status.get("learners") if isinstance(status.get("learners"), Mapping) else {}
        for key, entry in learners.items():
            if not (isinstance(key, str) and key.isdigit() and isinstance(entry, Mapping)):
                continue
            for counter, field in ((self.joins, "joins"), (self.rejected, "rejected"), (self.capped, "capped")):
                value = entry.get(field)
                if isinstance(value, int) and not isinstance(value, bool) and value > counter[int(key)]:
                    counter[int(key)] = value
        received, sent = (status.get(field) for field in ("bytes_received", "bytes_sent"))
        if all(isinstance(value, int) and not isinstance(value, bool) for value in (received, sent)):
            self.bytes_base = (max(self.bytes_base[0], received), max(self.bytes_base[1], sent))
        watched = status.get("bytes_watched")
        if isinstance(watched, int) and not isinstance(watched, bool):
            self.bytes_watched = max(self.bytes_watched, watched)

    def count_rejection(self, reason: str, learner_id: int | None) -> None:
        self.rejections[reason] += 1
        if learner_id is not None and 0 <= learner_id < self.num_learners:
            self.rejected[learner_id] += 1  # not per claimed id outside the run: one entry each would pile up

    def count_commit(self, record: RoundRecord, shares: Sequence[float], *, capped: Sequence[int] = ()) -> None:
        self.capped.update(capped)
        for p in record.participants:
            tally = self.participation.setdefault(p.learner_id, {"accepted": 0, "tokens_merged": 0.0})
            tally["accepted"] += 1
            tally["tokens_merged"] += merged_tokens(p.tokens, shares[record.fragment])

    def meta(self, syncer: Syncer) -> dict[str, Any]:
        """The counters a full state keeps (`Restored.meta` when it is loaded)."""
        received, sent = self.bytes_base
        return {"rejections": dict(self.rejections), "rejected": {str(k): v for k, v in self.rejected.items()},
                "joins": {str(k): v for k, v in self.joins.items()},
                "capped": {str(k): v for k, v in self.capped.items()},
                "bytes_received": received + syncer.bytes_received, "bytes_sent": sent + syncer.bytes_sent,
                "bytes_watched": self.bytes_watched}

    def status(self, syncer: Syncer | None, *, address: str, min_quorum: int, sends_dropped: int) -> dict[str, Any]:
        """The `syncer_status.json` document. `syncer`: None before the run has its genesis, when the quorum shown
        is the run config's `min_quorum`."""
        s = syncer
        received, sent = self.bytes_base
        if s is None:
            return {"time": time.time(), "pid": os.getpid(), "address": address, "genesis": False,
                    "rounds_committed": 0, "versions": [], "alive_learners": [], "stalled_learners": [],
                    "min_quorum": min_quorum, "effective_quorum": 0, "grace_s": 0.0,
                    "step_time_s": None, "quorum_time_s": None, "sync_time_s": None, "path_time_s": None,
                    "rejections": dict(self.rejections), "bytes_received": received, "bytes_sent": sent,
                    "bytes_watched": self.bytes_watched, "learners": {}, "sends_dropped": sends_dropped,
                    "storage_error": None}
        learners = {}
        for learner_id in sorted(set(s.learners) | set(self.participation) | set(self.joins)):
            tally = self.participation.get(learner_id, {})
            info = s.learners.get(learner_id)
            learners[str(learner_id)] = {
                "accepted": tally.get("accepted", 0), "rejected": self.rejected[learner_id],
                "tokens_merged": round(tally.get("tokens_merged", 0)), "joins": self.joins[learner_id],
                "capped": self.capped[learner_id], "alive": bool(info is not None and info.alive),
                "stalled": bool(info is not None and info.alive and info.stalled),
                "step_time_s": None if info is None else info.step_time_s,
                "path_time_s": None if info is None else info.path_time_s}
        return {
            "time": time.time(), "pid": os.getpid(), "address": address, "genesis": True,
            "rounds_committed": s.rounds_committed, "versions": list(s.versions),
            "alive_learners": s.alive_learners(), "stalled_learners": s.stalled_learners(),
            "min_quorum": s.quorum.min_quorum,
            "effective_quorum": s.effective_quorum(), "grace_s": s.grace_window(),
            "step_time_s": s.step_time.value, "quorum_time_s": s.quorum_time.value,
            "sync_time_s": s.sync_time.value, "path_time_s": s.path_time.value, "rejections": dict(self.rejections),
            "bytes_received": received + s.bytes_received, "bytes_sent": sent + s.bytes_sent,
            "bytes_watched": self.bytes_watched, "learners": learners, "sends_dropped": sends_dropped,
            "storage_error": s.storage_error,
        }


def _counts(value: Any) -> dict[str, int]:
    """A status document's {reason: count}, without entries that are not counts."""
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}
