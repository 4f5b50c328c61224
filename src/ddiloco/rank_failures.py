"""Which rank of a learner of several ranks failed first, when the others fail with it.

When one rank raises, the others fail after it, in a collective with it (a gloo "connection closed", an NCCL
abort), and one of them may exit before it does: the raising rank still prints its traceback and tears its
interpreter down. The order of the exits does not say which rank broke; the order of the failures does. So each
rank's session records, the moment an exception leaves the user's `with ddiloco.session(...)` block and before the
session does anything another rank could notice, when it failed and whether every other rank was still alive then
(`record`): a failure while a peer was already dead is a consequence of that death (a rank killed by a signal
records nothing). The rank group (`ddiloco.runtime.rank_group`) gives each rank the folder to record in
(`DDILOCO_RANK_FAILURES`) and the ranks' pids (`RANKS_FILE` in it), and names the rank to blame (`first_failed`).

Linux only, like the rank group: a peer is dead when its `/proc/PID/stat` is gone or says zombie. The times are
`time.monotonic()`, one clock for every process of the machine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.launcher_watch import process_start_time

logger = logging.getLogger(__name__)

DEATH_SETTLES_S = 0.2
"""How long after its failure a rank looks again whether its peers live (`record`)."""
RANKS_FILE = "ranks.json"
"""`{"ranks": [pid of rank 0, ...]}`, written by the rank group once every rank has started."""


def _record_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


def record(directory: Path | None, rank: int, *, explains: bool = False) -> None:
    """Record that `rank` failed now (an exception left its session's block), in `directory` (None: not in a rank
    group, nothing to do); `explains`: its error says what broke between the ranks (`RanksOutOfStepError`), and is
    the one to show even when another rank's failure was recorded first (a timed-out gloo barrier may close its
    connections, and the other rank's "connection closed" came a few milliseconds before this record). Never raises:
    it runs while an exception is on its way out."""
    if directory is None:
        return
    try:
        now = time.monotonic()
        alive = _peers_alive(directory)
        if alive and not explains:
            # A peer killed a moment ago closes its connections (this rank's failure) before the kernel marks it dead:
            # seen alive, it was the killed rank 0 whose death rank 1's "connection reset" was named for. Nothing of
            # this rank's failure has reached the others yet, so a peer dead a moment later died of something else.
            time.sleep(DEATH_SETTLES_S)
            alive = _peers_alive(directory)
        atomic_write_json(_record_path(directory, rank), {"rank": rank, "time": now, "explains": explains,
                                                          "peers_alive": alive}, durable=False)
    except (OSError, ValueError) as exc:
        logger.debug("could not record rank %d's failure in %s: %s", rank, directory, exc)


def _peers_alive(directory: Path) -> bool:
    """Whether every other rank of the group is alive (True when their pids are not known yet)."""
    pids = (read_json_object(directory / RANKS_FILE) or {}).get("ranks")
    if not isinstance(pids, list):
        return True
    return all(_alive(pid) for pid in pids if isinstance(pid, int) and pid != os.getpid())


def _alive(pid: int) -> bool:
    return process_start_time(pid) is not None  # gone, or a zombie: dead


def first_failed(directory: Path, failed: Iterable[int]) -> int:
    """The rank to blame for the group's failure, `failed` being the ranks found exited with a failure (at least one):
    the earliest whose error explains it (`record`'s `explains`); else the rank that recorded the earliest failure
    while every other rank was alive, whether or not it has exited yet; failing that, of `failed`, a rank that recorded
    nothing (killed by a signal, or failing outside its session) before one that failed after a peer's death, the
    lowest first."""
    records = {}
    for path in directory.glob("rank-*.json"):
        found = read_json_object(path) or {}
        if isinstance(found.get("rank"), int) and isinstance(found.get("time"), int | float):
            records[found["rank"]] = found
    causes = [(entry["time"], rank) for rank, entry in records.items() if entry.get("explains") is True]
    causes = causes or [(entry["time"], rank) for rank, entry in records.items() if entry.get("peers_alive") is True]
    if causes:
        return min(causes)[1]
    return min(failed, key=lambda rank: (rank in records, rank))
