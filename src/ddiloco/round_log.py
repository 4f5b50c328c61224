"""The round log: `rounds.jsonl` (one committed round per line, `RoundRecord.to_json()` plus the checksum of the
round's tensors file) and the merged pseudo-gradient of every round in `rounds/round_NNNNNN.safetensors`, enough to
replay the global state bit for bit (`ddiloco.syncer.replay_rounds`). The tensors are written first (atomically,
`ddiloco.checkpoint.save_tensors`) and the line last: a round is committed once its line is durable. Every tensors
file is checked against the checksum its line recorded when it is read back, and a damaged round is an error (a round
log cannot skip a round), and so is a damaged line of the log (not JSON, not a round record, out of order), named by
file and line.

Only one process (the syncer) appends; anyone may read. This module knows nothing of the syncer; it stores what it
hands it. The syncer may remove the tensors files of rounds its full states already hold (`prune_before`): their
lines stay, so the log still records every round, but a replay from the genesis then needs them back.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ddiloco.checkpoint import CHECKSUM_KEY, load_tensors, save_tensors
from ddiloco.messages import Participant, RoundRecord

logger = logging.getLogger(__name__)

READ_BLOCK_BYTES = 1 << 16
"""How far back from the log's end one read looks for its last newline (`RoundLog._ends`): a line is a few kB."""


def round_record_from_json(line: dict[str, Any], merged: dict[str, torch.Tensor]) -> RoundRecord:
    return RoundRecord(
        round_index=int(line["round"]), fragment=int(line["fragment"]), version=int(line["version"]),
        participants=tuple(Participant(**{**p, "folded": tuple(tuple(int(v) for v in f) for f in p.get("folded", ()))})
                           for p in line["participants"]), merged=merged,
        opened_at=float(line["opened_at"]), quorum_at=float(line["quorum_at"]),
        closed_at=float(line["closed_at"]), grace_s=float(line["grace_s"]),
        rejections=tuple((int(i), str(r)) for i, r in line.get("rejections", ())),
        summed=tuple(int(i) for i in line.get("summed", ())))


LOG_DAMAGED = "the round log is damaged: restore rounds.jsonl from a backup"
"""How every refusal of a damaged `rounds.jsonl` ends. A run does not go on from its full state alone, even one that
holds every round: replays, audits (`ddiloco chaos`) and the participation counts read the record of every committed
round, and rounds appended after a hole would leave it there for good (docs/runtime.md, Durability and restarts)."""


class RoundFileRemoved(ValueError):
    """A round's tensors file was removed on purpose, once the syncer's full states held it (`RoundLog.prune_before`):
    a reader replaying from an older state than the newest meets it when the syncer moved on while it read."""


class RoundLog:
    """`rounds.jsonl` plus `rounds/round_NNNNNN.safetensors` in a run directory. See the module
    docstring. Only one process (the syncer) appends; anyone may read."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "rounds.jsonl"
        self.tensor_dir = self.run_dir / "rounds"
        self._pruned_below: int | None = None
        """Every tensors file below this round was removed by `prune_before` (None: not looked yet)."""
        self.bytes_read = 0
        """How far the current (or last) read of the lines got, in bytes: its progress, for a long log."""

    def tensors_path(self, round_index: int) -> Path:
        return self.tensor_dir / f"round_{round_index:06d}.safetensors"

    def append(self, record: RoundRecord) -> None:
        """Make `record` durable: its merged tensors, then its line (the commit point). All or nothing: when a
        write fails (a full disk), the log is cut back to where it was and the round's tensors file removed, so
        the same round can be appended again later and the log never holds a torn or missing line."""
        tensors = self.tensors_path(record.round_index)
        checksum = save_tensors(tensors, dict(record.merged))
        line = (json.dumps({**record.to_json(), CHECKSUM_KEY: checksum}, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes of the round's line")
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, end)
                tensors.unlink(missing_ok=True)
                raise
        finally:
            os.close(fd)

    def prune_before(self, round_index: int) -> int:
        """Remove the tensors files of rounds below `round_index` (their lines stay); returns how many it removed.
        For the syncer, once a full state it keeps holds those rounds (`SyncerStore.save`). The first call of a
        process lists the directory; later ones remove only the rounds since the last call."""
        if self._pruned_below is None:
            candidates = sorted(index for index in self._held_rounds() if index < round_index)
        else:
            candidates = list(range(self._pruned_below, round_index))
        removed = 0
        for index in candidates:
            try:
                self.tensors_path(index).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        self._pruned_below = max(round_index, self._pruned_below or 0)
        return removed

    def first_held(self) -> int | None:
        """The lowest round whose tensors file is present, None without any. Lists the directory."""
        return min(self._held_rounds(), default=None)

    def _held_rounds(self) -> list[int]:
        """The rounds whose tensors file is present, in no order."""
        stems = (path.stem.removeprefix("round_") for path in self.tensor_dir.glob("round_*.safetensors"))
        return [int(stem) for stem in stems if stem.isdigit()]

    def _raw_lines(self) -> Iterator[bytes]:
        """Each whole line without its newline, in order, read a block at a time (a log of a million rounds is
        gigabytes); a torn last line (a crash while appending, or a line being appended as it is read) is none.
        Split on b"\n" only: json.dumps escapes every other line break, so these are the appender's lines."""
        try:
            file = self.path.open("rb")
        except FileNotFoundError:
            return
        self.bytes_read = 0
        with file:
            for raw in file:
                if raw.endswith(b"\n"):
                    self.bytes_read += len(raw)
                    yield raw[:-1]

    def size(self) -> int:
        """The log's size in bytes, 0 before its first round."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _ends(self) -> tuple[int, int]:
        """(the size of the log's whole lines, the length of what follows them: a torn last line, 0 without one),
        read back from the file's end only as far as its last newline."""
        try:
            file = self.path.open("rb")
        except FileNotFoundError:
            return 0, 0
        with file:
            size = end = file.seek(0, os.SEEK_END)
            while end > 0:
                start = max(0, end - READ_BLOCK_BYTES)
                file.seek(start)
                newline = file.read(end - start).rfind(b"\n")
                if newline >= 0:
                    return start + newline + 1, size - (start + newline + 1)
                end = start
            return 0, size

    def torn_bytes(self) -> int:
        """The length of a torn last line, 0 without one. Reads only."""
        return self._ends()[1]

    def repair(self) -> int:
        """Cut a torn last line (a crash while appending) so later appends start on a fresh line;
        returns the number of complete lines. Call once, before the first append of a process, and only once the
        log is known to be consistent with the state it continues (`SyncerStore.restore`): cutting is the one
        change a reader of the log ever makes to it."""
        whole, torn = self._ends()
        if torn:
            logger.warning("round log %s ends with a torn line (%d bytes); cutting it", self.path, torn)
            with self.path.open("r+b") as file:
                file.truncate(whole)
                file.flush()
                os.fsync(file.fileno())
        return sum(1 for _ in self._raw_lines())

    def lines(self) -> list[dict[str, Any]]:
        """Every complete line, in order (a torn last line is skipped), each a JSON object with an integer
        "round". A line that is not is a ValueError naming the file and the line (1-based, as `sed -n Np` counts)."""
        return [self.parse_line(raw, number) for number, raw in enumerate(self._raw_lines(), start=1)]

    def parse_line(self, raw: bytes, number: int) -> dict[str, Any]:
        """Line `number` (1-based) of the log, `raw` without its newline, as a JSON object with an integer "round"; a
        ValueError naming the file and the line when it is not one."""
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path} line {number} is not valid JSON ({exc.msg} at column {exc.colno}): "
                             f"{LOG_DAMAGED}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path} line {number} is not valid JSON ({exc}): {LOG_DAMAGED}") from None
        if not isinstance(line, dict) or type(line.get("round")) is not int:
            raise ValueError(f"{self.path} line {number} is not a round record (a JSON object with an integer "
                             f'"round"): {LOG_DAMAGED}')
        return line

    def numbered(self) -> Iterator[dict[str, Any]]:
        """The complete lines, in order, one at a time (`lines()` without holding them all), checked to hold rounds
        0, 1, 2, ... one per line: line N holds round N - 1. A ValueError names the first line that does not and the
        round that belongs there (a line lost, repeated or moved), so a gap is never read as a log whose end was
        lost."""
        for index, raw in enumerate(self._raw_lines()):
            yield self.parse_numbered(raw, index)

    def parse_numbered(self, raw: bytes, index: int) -> dict[str, Any]:
        """Line `index` + 1 of the log (`parse_line`), checked to hold round `index`; a ValueError naming the line and
        the round that belongs there when it does not."""
        line = self.parse_line(raw, index + 1)
        if line["round"] != index:
            raise ValueError(f"{self.path} line {index + 1} holds round {line['round']} where round {index} "
                             f"should be (a line lost, repeated or moved): {LOG_DAMAGED}")
        return line

    def records(self, *, start: int = 0) -> Iterator[RoundRecord]:
        """Rounds `start`, `start + 1`, ... with their merged tensors, checking the numbering (`numbered`) of every
        line, those before `start` too, and each tensors file read against the checksum its line recorded. A damaged
        round is a ValueError naming it and its file: a replay cannot skip a round, so the file must come back from a
        backup."""
        for line in self.numbered():
            if line["round"] >= start:
                yield self.record(line)

    def record(self, line: dict[str, Any]) -> RoundRecord:
        """The round one of `numbered()`'s lines records, with its merged tensors (`load_merged`); a ValueError naming
        the line when a field is missing or not what a round record holds."""
        merged = self.load_merged(line)
        try:
            return round_record_from_json(line, merged)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{self.path} line {line['round'] + 1} (round {line['round']}) is not a round record "
                             f"({type(exc).__name__}: {exc}): {LOG_DAMAGED}") from None

    def load_merged(self, line: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The merged pseudo-gradient of the round `line` (one of `lines()`) records, checked against the checksum
        the line recorded; a ValueError naming the round and its file when it is damaged."""
        index = int(line["round"])
        path = self.tensors_path(index)
        if CHECKSUM_KEY not in line:
            raise ValueError(f"{self.path}: round {index} records no checksum of {path.name} (a round log written "
                             "before round files had one, which this version does not replay): start a new run "
                             "directory")
        try:
            return load_tensors(path, checksum=line[CHECKSUM_KEY])
        except FileNotFoundError:
            first = self.first_held()
            if first is not None and index < first:
                raise RoundFileRemoved(
                    f"{self.path}: round {index}'s tensors file {path.name} was removed, as every round before {first} "
                    "was, once the syncer's full states held them (a syncer keeps round files back to its older full "
                    "state unless started with --round-files all): a replay from the genesis, or from a full state "
                    f"older than round {first}, cannot be done in this run directory") from None
            raise ValueError(f"{self.path}: round {index} is damaged (its tensors file {path.name} is missing): "
                             "restore it from a backup; a round log cannot skip a round") from None
        except (OSError, ValueError, SafetensorError) as exc:
            raise ValueError(f"{self.path}: round {index} is damaged ({exc}): restore {path.name} from a "
                             "backup; a round log cannot skip a round") from None
