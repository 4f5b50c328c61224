"""Durable files: atomic writes, strict JSON, checksums and state checkpoints (safetensors + JSON).

Everything is written the same way: to a temporary file in the target's directory, flushed,
fsynced, renamed over the target, and the directory fsynced, so a crash (even `kill -9` or a power
cut) leaves either the old file or the new one, never a torn one. Tensors go into safetensors files
(no pickle: loading a checkpoint never runs code); everything else into JSON.

- `save_state` / `load_latest_state`: a nested state dict (a syncer's global parameters and outer
  momentum, a learner's AdamW state and data cursor) split into its tensors and numpy arrays (one
  safetensors file) and the rest (one JSON file that names the tensors file and records its checksum).
  The JSON file is the commit point: written last, so a state exists exactly when its JSON does. The
  latest few are kept. The split (`ddiloco.state_tree.split_state`) may run apart from the write
  (`save_split_state`), so that a value a checkpoint cannot keep is refused where the state was taken, not in the
  thread that writes it.
- the round log is `ddiloco.round_log`'s, which writes its files with these.

Atomic writes guard against crashes, not against a disk that later returns other bytes than it was
given. Every tensors file's checksum (`bytes_checksum`) is therefore recorded at its commit point and
checked whenever the file is read back (`load_tensors(path, checksum=...)`): a damaged state is
skipped for an older one (a damaged round is an error: `ddiloco.round_log`).

This module knows nothing of learners or the syncer; it stores what they hand it.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ddiloco.state_tree import join_state, split_state, state_path

logger = logging.getLogger(__name__)

KEEP_STATES = 2
"""How many durable states a directory keeps: the newest, plus one in case the newest is damaged."""
_STATE_NAME = re.compile(r"^state_(\d{9})\.json$")
_TEMP_NAME = re.compile(r"^\..+\.(\d+)\.tmp$")
"""A file `atomic_write_bytes` was writing: `.NAME.PID.tmp`."""
CHECKSUM_KEY = "tensors_checksum"
"""Where a state's JSON, a round's line and the genesis metadata record their tensors' checksum."""
# ---- atomic files --------------------------------------------------------------------------------

def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` all at once. `durable=False` skips the fsyncs (status files that
    are rewritten every second need atomicity, not durability)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as file:
            file.write(data)
            file.flush()
            if durable:
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep the half-written copy
        raise
    if durable:
        _fsync_dir(path.parent)


def learner_files(run_dir: str | Path, name: str) -> list[tuple[int, Path]]:
    """(learner id, path) of each learner's file `name` in `run_dir`/learners/N/ that exists, by learner id: the
    learners' buffers (`ddiloco.model_buffers`) and copies of the global model (`ddiloco.global_copy`)."""
    root = Path(run_dir) / "learners"
    if not root.is_dir():
        return []
    found = [(int(d.name), d / name) for d in root.iterdir() if d.name.isdigit()]
    return sorted((learner_id, path) for learner_id, path in found if path.is_file())


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Remove the files `atomic_write_bytes` left in `directory` (not below it) when its process was killed while
    writing (`.NAME.PID.tmp`, PID no longer running; a live one's are its writes in flight); returns them. Nothing else
    removes them, and they would stay through every later save and resume: a probe's kill -9 in the middle of writes
    left six, each the size of what was being written (a syncer state is 12 bytes per parameter)."""
    removed = []
    try:
        names = list(Path(directory).iterdir())
    except OSError:
        return removed
    for path in names:
        match = _TEMP_NAME.match(path.name)
        if match is None or _running(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass  # gone meanwhile, or not ours to remove
    if removed:
        logger.info("removed %d file(s) a killed process left half-written in %s: %s", len(removed), directory,
                    ", ".join(p.name for p in removed))
    return removed


def _running(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # not ours to signal (or no such number): leave its files alone
    return True


class WriteTrouble:
    """For files a run rewrites and can do without for a while (status files, metrics, periodic
    checkpoints): an OSError (a full disk, a read-only mount) is counted and logged once when writes start
    failing and once when they work again, and never raised, so the run goes on. Thread-safe."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0
        self.failing: str | None = None
        """The last error while writes fail; None while they work."""
        self._lock = threading.Lock()

    def attempt(self, write: Callable[[], object]) -> bool:
        """Run `write()`; False when it raised OSError."""
        try:
            write()
        except OSError as exc:
            with self._lock:
                self.failures += 1
                first, self.failing = self.failing is None, str(exc)
            if first:
                logger.error("cannot write %s (%s): going on without it, retrying at its next write", self.what, exc)
            return False
        with self._lock:
            recovered, self.failing = self.failing is not None, None
        if recovered:
            logger.warning("%s written again (%d writes failed so far)", self.what, self.failures)
        return True


# ---- strict JSON ------------------------------------------------------------------------------------

def finite_json(value: Any) -> tuple[Any, list[str]]:
    """`value` with every float that is not finite (NaN, an infinity) replaced by None, and where each one was
    (`/metrics/val_loss`). Dicts, lists and tuples are copied where they hold one; anything else is kept as it is."""
    replaced: list[str] = []

    def walk(item: Any, keys: tuple[Any, ...]) -> Any:
        if isinstance(item, float) and not math.isfinite(item):  # np.float64 is a float too
            replaced.append(state_path(keys))
            return None
        if isinstance(item, dict):
            return {k: walk(v, (*keys, k)) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [walk(v, (*keys, i)) for i, v in enumerate(item)]
        return item

    return walk(value, ()), replaced


def strict_dumps(value: Any, **options: Any) -> tuple[str, list[str]]:
    """`json.dumps(value, **options)` as strict JSON, and where a value that is not finite was written as null.
    Python's json writes NaN and infinities as the bare words NaN and Infinity, which JSON does not have: jq,
    JavaScript's JSON.parse and most other readers refuse the whole file. Only a value that holds one is copied."""
    try:
        return json.dumps(value, allow_nan=False, **options), []
    except ValueError:
        finite, replaced = finite_json(value)
        return json.dumps(finite, allow_nan=False, **options), replaced


class JsonLines:
    """An append-only file of JSON lines (metrics, a learner's work ledger), appended across restarts. Each
    line goes out whole in one write, so a kill -9 loses no line already appended and threads may append at
    once. A line that cannot be written (a full disk) is dropped whole, never torn, and the run goes on; once
    writing works again, a `{"event": "dropped_lines", "lines": n, "total": t}` line says how many were lost.
    Appending after `close` does nothing. Lines are strict JSON: a value that is not finite (a NaN loss) is written
    as null, and said once per file in the log."""

    def __init__(self, path: str | Path, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._release_fd = weakref.finalize(self, os.close, self._fd)
        """Closes the file if this object goes without `close` (a session made and dropped without being entered held
        its metrics.jsonl and work.jsonl open for the life of the process). Not at the interpreter's exit, where a
        daemon thread may still append."""
        self._release_fd.atexit = False
        self._mid_line = _ends_mid_line(self.path)
        """The file ends in a line cut short (a host crash mid-write): the first line appended starts on a line of its
        own, else it was glued to the cut one and both were lost to every reader."""
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._trouble = WriteTrouble(str(self.path))
        self.dropped = 0
        self._unreported = 0
        self._nulls_told = False

    def append(self, record: Mapping[str, Any]) -> bool:
        """Append one line; False when it was dropped (or the file is closed)."""
        text, replaced = strict_dumps(record, default=str)
        data = (text + "\n").encode()
        with self._lock:
            if replaced and not self._nulls_told:
                self._nulls_told = True
                logger.warning("%s: %s not finite (NaN or an infinity): written as null, since JSON has neither; "
                               "said once per file", self.path, ", ".join(where[1:] for where in replaced))
            if self._fd is None:
                return False
            if self._unreported:
                report = {"event": "dropped_lines", "time": self._wall_clock(), "lines": self._unreported,
                          "total": self.dropped}
                if self._trouble.attempt(lambda: self._write((json.dumps(report) + "\n").encode())):
                    self._unreported = 0
            if self._trouble.attempt(lambda: self._write(data)):
                return True
            self.dropped += 1
            self._unreported += 1
            return False

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        end = os.lseek(self._fd, 0, os.SEEK_END)
        data = b"\n" + data if self._mid_line else data
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
        except OSError:
            os.ftruncate(self._fd, end)  # no torn line: readers parse every line
            raise
        self._mid_line = False

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                self._fd = None
                self._release_fd()


def _ends_mid_line(path: Path) -> bool:
    """Whether `path` is not empty and its last byte is not a newline."""
    try:
        with path.open("rb") as file:
            if file.seek(0, os.SEEK_END) == 0:
                return False
            file.seek(-1, os.SEEK_END)
            return file.read(1) != b"\n"
    except OSError:
        return False


def atomic_write_json(path: str | Path, value: Any, *, durable: bool = True, allow_nan: bool = False) -> None:
    """Replace `path` with `value` as JSON. Strict JSON (`strict_dumps`: a value that is not finite is written as
    null) unless `allow_nan`, for a file only Python reads back that must keep its NaNs and infinities as they were
    (a checkpoint's state)."""
    text = json.dumps(value, indent=1, sort_keys=True) if allow_nan else \
        strict_dumps(value, indent=1, sort_keys=True)[0]
    atomic_write_bytes(path, (text + "\n").encode(), durable=durable)


def read_json(path: str | Path) -> Any | None:
    """The JSON in `path`, or None when it does not exist or is not (yet) valid JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def read_json_object(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in `path` (a status file another process rewrites atomically), or None when it does not
    exist, is not valid JSON, or holds something other than an object."""
    value = read_json(path)
    return value if isinstance(value, dict) else None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, [] when it does not exist; a torn line (its writer killed mid-line) and
    anything that is not an object are skipped."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """`read_jsonl`'s objects one at a time, for files too long to hold (a long run's metrics: a line per inner step).
    Nothing when the file does not exist."""
    try:
        with Path(path).open(encoding="utf-8", errors="replace") as file:
            for line in file:
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(value, dict):
                    yield value
    except FileNotFoundError:
        return


# ---- checksums -------------------------------------------------------------------------------------

def canonical_safetensors(data: bytes) -> bytes:
    """`data`, a safetensors file, with its metadata's entries in sorted order: safetensors writes them in a random
    order (a hash map), so two saves of the same tensors and metadata differed (twenty gave six byte strings). The
    tensors' entries keep their order (their offsets') and the data is unchanged; the header is padded to 8 bytes as
    safetensors pads it."""
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    if "__metadata__" in header:
        header = {"__metadata__": dict(sorted(header["__metadata__"].items())),
                  **{name: entry for name, entry in header.items() if name != "__metadata__"}}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


def bytes_checksum(*parts: bytes | memoryview) -> str:
    """The checksum recorded for a file's bytes (`parts`, in order, checksum the bytes they hold one after the
    other, with no copy): "crc32:" and 8 hex digits. CRC-32, as on the wire: it catches
    every single-bit flip and every burst up to 32 bits long, and misses other damage about once in 2**32.
    It guards against a failing disk or a bad copy, not against someone who rewrites a file and its record
    together (a cryptographic hash would not stop them either: they would rewrite the record too). It runs
    at 1-2 GB/s here (docs/runtime.md)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return f"crc32:{crc:08x}"


class ChecksumError(ValueError):
    """A file's bytes differ from those whose checksum was recorded when it was written: it is damaged."""


def verify_checksum(what: str | Path, recorded: str, *parts: bytes | memoryview) -> None:
    """Raise ChecksumError unless `parts` (`what`: a path, or which part of a file) have the checksum `recorded`."""
    found = bytes_checksum(*parts)
    if found != recorded:
        raise ChecksumError(f"the checksum of {what} is {found}, but {recorded} was recorded when it was written")


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write tensors into one safetensors file, atomically and durably; returns the checksum of the bytes written, for
    the caller to record at its commit point. Nothing may change them meanwhile (every caller holds them alone or
    under its lock): the file is serialised from them here, before this returns."""
    data = save_safetensors(_serialisable(tensors))
    # zlib releases the GIL while it checksums, so the CRC runs while the bytes go to disk and the fsyncs
    # wait: a 100 MB round commit costs no more with it (benchmarks/bench_checksums.py).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum") as pool:
        checksum = pool.submit(bytes_checksum, data)
        atomic_write_bytes(path, data)
        return checksum.result()


def _serialisable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` as safetensors writes them: on the CPU and contiguous, each alone in its memory. A tensor that shares
    its memory (a view of a larger one, or the same memory under two names: safetensors refuses both) is copied; the
    others are written as they are. Copying every tensor would hold a learner's checkpoint of its already copied
    optimizer state three times while writing (that copy, this one and the serialised bytes): at 57 M parameters with
    AdamW, 911 MB above the snapshot at a process's first write against 458 MB without it (later writes reuse freed
    memory: 458-477 MB), and 8 GB more for a billion parameters."""
    plain, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage()
        alone = (tensor.numel() > 0 and tensor.storage_offset() == 0
                 and storage.nbytes() == tensor.numel() * tensor.element_size() and storage.data_ptr() not in seen)
        plain[name] = tensor if alone else tensor.clone()
        seen.add(plain[name].untyped_storage().data_ptr())
    return plain


def load_tensors(path: str | Path, *, checksum: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors in a safetensors file; with `checksum` (what `save_tensors` returned), a ChecksumError when
    the file's bytes no longer match it. The run's own files are always read with their checksum."""
    data = Path(path).read_bytes()
    if checksum is not None:
        verify_checksum(path, checksum, data)
    return load_safetensors(data)


# ---- durable states --------------------------------------------------------------------------------

def state_files(directory: Path) -> list[tuple[int, Path]]:
    """The states kept in `directory`, oldest first: each one's serial and JSON file (a state exists once its JSON
    does). Reads names only."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / m.group(0))
             for m in (_STATE_NAME.match(p.name) for p in directory.iterdir()) if m]
    return sorted(found)


def save_state(directory: str | Path, state: Any, *, serial: int, meta: dict[str, Any] | None = None) -> Path:
    """Write `state` durably as `state_<serial>.{safetensors,json}` and drop all but the newest
    KEEP_STATES. `serial` orders states (the syncer uses rounds committed, a learner its inner
    step); saving the same serial twice replaces it. Returns the JSON path (the commit point)."""
    return save_split_state(directory, split_state(state), serial=serial, meta=meta)


def save_split_state(directory: str | Path, split: tuple[dict[str, torch.Tensor], Any], *, serial: int,
                     meta: dict[str, Any] | None = None) -> Path:
    """`save_state` of a state `split_state` has already split: `split` is what it returned."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, tree = split
    stem = f"state_{serial:09d}"
    checksum = save_tensors(directory / f"{stem}.safetensors", tensors)
    json_path = directory / f"{stem}.json"
    # allow_nan: a state must come back as it was (ReduceLROnPlateau's `best` starts at inf).
    atomic_write_json(json_path, {"serial": serial, "tensors": f"{stem}.safetensors", CHECKSUM_KEY: checksum,
                                  "state": tree, "meta": meta or {}}, allow_nan=True)
    for _, old in state_files(directory)[:-KEEP_STATES]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)
    remove_stale_temps(directory)
    return json_path


def load_latest_state(directory: str | Path) -> tuple[Any, dict[str, Any], int] | None:
    """(state, meta, serial) of the newest readable state in `directory`, or None if there is none.
    A damaged state (unreadable JSON, a tensors file missing, torn or whose checksum does not match, or
    no checksum recorded: written before states had one) is logged and skipped for the previous one."""
    damaged = 0
    for serial, json_path in reversed(state_files(Path(directory))):
        record = read_json(json_path)
        try:
            if record is None:
                raise ValueError("unreadable JSON")
            if CHECKSUM_KEY not in record:
                raise ValueError("no checksum recorded for its tensors (written before states had one)")
            tensors = load_tensors(json_path.parent / record["tensors"], checksum=record[CHECKSUM_KEY])
            return join_state(record["state"], tensors), record.get("meta", {}), serial
        except (OSError, ValueError, KeyError, SafetensorError) as exc:
            damaged += 1
            logger.error("checkpoint %s is damaged (%s); trying an older one", json_path, exc)
    if damaged:
        logger.error("no readable state in %s: all %d kept are damaged", directory, damaged)
    return None
