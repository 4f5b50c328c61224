"""The syncer's durable state: what survives `kill -9`, and how a restarted syncer gets it back.

Layout in the run directory:

    genesis.safetensors                   the run's initial global parameters (written once, before any
                                          round), with their order, embeddings and the checksum of their
                                          bytes in its metadata
    rounds.jsonl                          one committed round per line (RoundRecord.to_json())
    rounds/round_NNNNNN.safetensors       that round's merged pseudo-gradient
    checkpoints/syncer/state_NNNNNNNNN.*  full states: global parameters, outer momentum, versions,
                                          rounds committed, per-learner merged versions (+ counters)

Every round is made durable (its tensors, then its line, each fsynced) before the service sends its
result to any learner. A full state is written with the genesis, every `full_state_every_rounds` rounds and
at a clean stop; it costs the whole model plus its momentum, so it is not written every round.
Once a full state is written, the tensors files of the rounds before the older of the two kept states are
removed (their lines stay): a restart replays from one of those states, so the files are needed only for a replay
from the genesis (`ddiloco chaos` audits one), and without the pruning `rounds/` grows by about 4 x N / H bytes
per inner step for good. `keep_round_files` keeps them all.
Restoring loads the newest full state and replays the rounds the log holds after it, through the
same outer optimizer (`replay_onto`), which reproduces the lost in-memory state bit for bit: no
committed round is lost, and none is applied twice because the log's round numbers must continue
exactly where the state ends. A damaged log (a line that is no round record, a gap, an end below the state's
rounds) refuses the restore, naming the file and line, before anything on disk changes; the syncer does not go
on from a full state alone, since replays, audits and participation counts read every committed round's line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from ddiloco.checkpoint import (
    CHECKSUM_KEY,
    KEEP_STATES,
    atomic_write_bytes,
    bytes_checksum,
    load_latest_state,
    remove_stale_temps,
    save_state,
    state_files,
    verify_checksum,
)
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import RoundRecord
from ddiloco.model_buffers import persistent_buffers
from ddiloco.round_log import LOG_DAMAGED, RoundFileRemoved, RoundLog
from ddiloco.state_plan import plan_refusal, rounds_plan_difference
from ddiloco.syncer import Syncer, replay_rounds

logger = logging.getLogger(__name__)

STATE_DIR = Path("checkpoints") / "syncer"
GENESIS_FILE = "genesis.safetensors"
READ_PROGRESS_EVERY_S = 10.0
"""How often a read of the round log that takes long says how far it is (`SyncerStore._reading`)."""


@dataclass(frozen=True)
class GenesisRecord:
    """A run's initial global parameters (float32, in the model's parameter order) and which of them
    are embedding tables; `source` says where they came from (a learner, or an --init file)."""

    params: dict[str, torch.Tensor]
    embeddings: tuple[str, ...]
    source: str
    aliases: tuple[tuple[str, str], ...] = ()
    """Tied weights: (state_dict key, parameter name), so an export holds every key the model loads."""

    def syncer(self, config: DilocoConfig, quorum: QuorumConfig) -> Syncer:
        return Syncer(config, quorum, initial_params=self.params, embeddings=self.embeddings)


def write_genesis(run_dir: str | Path, genesis: GenesisRecord) -> None:
    """Durably, once: refuses to replace an existing genesis (nothing may change a run's origin)."""
    path = Path(run_dir) / GENESIS_FILE
    if path.exists():
        raise ValueError(f"{path} already exists: a run's genesis is written once")
    meta = {"order": json.dumps(list(genesis.params)), "embeddings": json.dumps(list(genesis.embeddings)),
            "source": genesis.source, "aliases": json.dumps([list(pair) for pair in genesis.aliases])}
    plain = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in genesis.params.items()}
    meta[CHECKSUM_KEY] = bytes_checksum(*_checksummed(save_safetensors(plain, metadata=meta)))
    data = save_safetensors(plain, metadata=meta)
    assert bytes_checksum(*_checksummed(data)) == meta[CHECKSUM_KEY]  # the data does not move with the metadata
    atomic_write_bytes(path, data)


def read_genesis(run_dir: str | Path) -> GenesisRecord | None:
    """The run's genesis, or None before it has one. A damaged file is an error, never a fresh start; so is a missing
    one beside the rounds it started (`_history`): a fresh start there made a new genesis, appended round 0 after the
    old log's last round and overwrote its round files, and the run could not be resumed or exported after."""
    path = Path(run_dir) / GENESIS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        history = _history(Path(run_dir))
        if history:
            raise ValueError(f"{path} is missing, but the run has {history}: restore it from a backup; the run "
                             "cannot go on without its genesis (a fresh start would mix a new history into this one)"
                             ) from None
        return None
    try:
        meta = _safetensors_metadata(data)
        if CHECKSUM_KEY not in meta:
            raise ValueError("no checksum recorded for its tensors (written before the genesis had one)")
        verify_checksum("its tensor data and metadata", meta[CHECKSUM_KEY], *_checksummed(data))
        tensors = load_safetensors(data)
        order = json.loads(meta["order"])
        embeddings = tuple(json.loads(meta["embeddings"]))
        aliases = tuple((str(a), str(n)) for a, n in json.loads(meta.get("aliases", "[]")))
    except (SafetensorError, KeyError, ValueError) as exc:
        raise ValueError(f"{path} is damaged ({exc}): restore it from a backup; the run cannot go on "
                         "without its genesis") from None
    if sorted(order) != sorted(tensors) or not set(embeddings) <= set(tensors):
        raise ValueError(f"{path} is damaged: its metadata does not match its tensors")
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path} is damaged: tensor {name!r} is not finite float32")
    return GenesisRecord({name: tensors[name] for name in order}, embeddings, meta.get("source", ""), aliases)


def _history(run_dir: Path) -> str:
    """What of a run's history `run_dir` holds ("" for none): committed rounds, or the syncer's full states."""
    rounds = RoundLog(run_dir).path
    with contextlib.suppress(OSError):
        if rounds.stat().st_size > 0:
            return f"committed rounds ({rounds.name} is not empty)"
    states = run_dir / STATE_DIR
    with contextlib.suppress(OSError):
        if any(states.iterdir()):
            return f"syncer states in {STATE_DIR}"
    return ""


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    return dict(header.get("__metadata__") or {})


def _checksummed(data: bytes) -> tuple[bytes, memoryview]:
    """What a genesis file's checksum covers: its metadata but the checksum (canonical JSON) and its tensor data
    (the bytes after the header), so the checksum can live in the file it checks (one file, written once).
    The rest of the header, the tensor table, is checked by parsing it and against the recorded order."""
    meta = {k: v for k, v in _safetensors_metadata(data).items() if k != CHECKSUM_KEY}
    return json.dumps(meta, sort_keys=True).encode(), memoryview(data)[8 + int.from_bytes(data[:8], "little"):]


INIT_NAMED_AT_MOST = 10
"""How many tensor names an --init refusal lists: a file of another model may differ in hundreds."""
INIT_HOLDS = ("an --init file holds the model's parameters, dict(model.named_parameters()); it may hold the model's "
              "buffers too, as a state_dict or a ddiloco export does, which are not taken from it: each learner keeps "
              "its own")


def load_init_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an --init safetensors file (e.g. `safetensors.torch.save_file(dict(model.named_parameters()),
    path)` of a pretrained model), or a ValueError that says what is wrong with it."""
    try:
        return load_safetensors(Path(path).read_bytes())
    except FileNotFoundError:
        raise ValueError(f"--init {path}: no such file") from None
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"--init {path} is not a readable safetensors file: {exc}") from None


def check_init_file(path: str | Path, model: nn.Module | None = None) -> None:
    """Raise a ValueError saying what is wrong unless `path` is a readable safetensors file that, given the `model`
    the learners will train, holds its parameters and nothing else, in their shapes (`init_mismatch`). For
    `ddiloco run` before it writes anything: it knows the built-in model; a script's is known at its first join
    (`genesis_from_init`). Reads the file's header only."""
    try:
        with safe_open(str(path), framework="pt") as file:
            shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}  # noqa: SIM118 (a safe_open handle is no dict: it cannot be iterated)
    except FileNotFoundError:
        raise ValueError(f"--init {path}: no such file") from None
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"--init {path} is not a readable safetensors file: {exc}") from None
    if model is None:
        return
    params = dict(model.named_parameters())
    canonical = {id(p): name for name, p in params.items()}
    aliases = tuple((alias, canonical[id(p)]) for alias, p in model.named_parameters(remove_duplicate=False)
                    if canonical[id(p)] != alias)
    reason = init_mismatch(shapes, {name: tuple(p.shape) for name, p in params.items()}, aliases,
                           buffers=tuple(persistent_buffers(model)))
    if reason is not None:
        raise ValueError(f"--init {path}: {reason}")


def init_mismatch(held: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]],
                  aliases: tuple[tuple[str, str], ...] = (), *, buffers: Iterable[str] = ()) -> str | None:
    """Why an --init file holding tensors of the shapes `held` (by name) does not fit a model whose parameters have
    `shapes` (in the model's order; `aliases`: (other name, parameter) of its tied weights, which the file may hold
    instead of the parameter's own name; `buffers`: the names of its persistent buffers, which the file may hold and
    which are not taken from it), or None. Names every parameter the file lacks and every tensor it holds that is
    neither a parameter nor a buffer, up to INIT_NAMED_AT_MOST of each; or else the first shape that differs."""
    held = {**{name: held[alias] for alias, name in aliases if alias in held and name not in held}, **held}
    missing = [name for name in shapes if name not in held]
    known = {*shapes, *dict(aliases), *buffers}
    extra = [name for name in held if name not in known]
    problems = []
    if extra:
        problems.append(f"holds {_count(extra, 'tensor')} the model has no parameter or buffer for: {_names(extra)}")
    if missing:
        what = "the model's parameter" if len(missing) == 1 else f"{len(missing)} of the model's parameters"
        problems.append(f"lacks {what} {_names(missing)}")
    if problems:
        return f"the --init file {' and '.join(problems)} ({INIT_HOLDS})"
    for name, shape in shapes.items():
        if tuple(held[name]) != tuple(shape):
            return f"the --init file holds {name!r} with shape {list(held[name])}, the model's is {list(shape)}"
    return None


def _count(names: Sequence[str], noun: str) -> str:
    return f"{len(names)} {noun}{'' if len(names) == 1 else 's'}"


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:INIT_NAMED_AT_MOST])
    return shown + (f" and {len(names) - INIT_NAMED_AT_MOST} more" if len(names) > INIT_NAMED_AT_MOST else "")


def genesis_from_init(init: Mapping[str, torch.Tensor], order: Iterable[str], embeddings: Iterable[str],
                      shapes: Mapping[str, tuple[int, ...]], source: str,
                      aliases: tuple[tuple[str, str], ...] = (), buffers: Iterable[str] = ()) -> GenesisRecord | str:
    """The genesis a --init file gives a joining model (its parameter names and shapes, in its order; `buffers`: the
    names of its persistent buffers), or why it cannot (`init_mismatch`: a parameter the file lacks, a tensor it
    holds that is neither parameter nor buffer, another shape), or a tensor that is not finite floating point. The
    buffers the file holds are not taken (each learner keeps its own), and the log says so."""
    order, buffers = list(order), tuple(buffers)
    reason = init_mismatch({name: tuple(t.shape) for name, t in init.items()},
                           {name: tuple(shapes[name]) for name in order}, aliases, buffers=buffers)
    if reason is not None:
        return reason
    skipped = [name for name in buffers if name in init]
    if skipped:
        logger.warning("[syncer] %s holds %s of the model's buffers (%s): not taken, each learner keeps its own",
                    source, len(skipped), _names(skipped))
    init = {**{name: init[alias] for alias, name in aliases if alias in init and name not in init}, **init}
    params = {}
    for name in order:
        tensor = init[name]
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            return f"the --init file's {name!r} is not a finite floating-point tensor"
        params[name] = tensor.to(torch.float32)
    return GenesisRecord(params, tuple(sorted(embeddings)), source, aliases)


EXPORT_READS = 3
"""How many times `exported_params` reads a live run whose syncer removed round files while it read."""


class Exported(NamedTuple):
    """What `exported_params` reads: a run's global parameters, under every name (tied weights under each)."""

    params: dict[str, torch.Tensor]
    rounds: int
    """The rounds committed that they hold."""
    aliases: tuple[str, ...]
    """The names in `params` that are a tied parameter's second name (a copy of another entry)."""


def exported_params(run_dir: str | Path, config: DilocoConfig) -> Exported:
    """The global parameters after the run's last committed round under every name the model's state_dict
    uses (tied weights under each of their names), and that round count; recomputed from the latest full
    state and the round log, as a restarted syncer would (what `ddiloco export` writes). Only reads the run
    directory: a torn last line of the log is skipped, not cut, because on a live run it is the round the syncer
    is appending, and cutting it could drop that round once committed. On a live run the syncer may also write newer
    full states while this reads and remove the round files after the one read (`RoundFileRemoved`): it is read
    again, from the newer state (`EXPORT_READS` times at most: a newest state that is damaged makes a restore fall
    back to the one before it, whose rounds may be gone for good)."""
    genesis = read_genesis(run_dir)
    if genesis is None:
        raise ValueError(f"{run_dir} has no {GENESIS_FILE}: no learner has joined this run yet")
    for attempt in range(1, EXPORT_READS + 1):
        syncer = genesis.syncer(config, QuorumConfig())
        try:
            SyncerStore(run_dir).restore(syncer, repair=False)
            break
        except RoundFileRemoved:
            if attempt == EXPORT_READS:
                raise
    params = syncer.global_params()
    for alias, name in genesis.aliases:
        params[alias] = params[name].clone()
    return Exported(params, syncer.rounds_committed, tuple(alias for alias, _ in genesis.aliases))


def replay_genesis(run_dir: str | Path, config: DilocoConfig,
                   records: Sequence[RoundRecord]) -> dict[str, torch.Tensor]:
    """The global parameters that `records` produce from the run's genesis (bit-exact replay)."""
    genesis = read_genesis(run_dir)
    if genesis is None:
        raise ValueError(f"{run_dir} has no {GENESIS_FILE}")
    return replay_rounds(config, genesis.params, records)


def replay_onto(syncer: Syncer, records: Sequence[RoundRecord]) -> None:
    """Apply committed rounds to a syncer whose state ends right before the first of them."""
    syncer.apply_committed(records)


@dataclass
class Restored:
    """What `SyncerStore.restore` found."""

    state_rounds: int = 0
    """Rounds included in the full state that was loaded (0 without one)."""
    replayed: int = 0
    """Rounds replayed from the log on top of it."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The service counters saved with the state."""
    found_state: bool = False


class SyncerStore:
    """The round log and full states of one run directory. Used under the service's lock."""

    def __init__(self, run_dir: str | Path, *, keep_round_files: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = Path(run_dir)
        self.clock = clock
        """For the progress of a long read of the log (`_reading`)."""
        self.log = RoundLog(self.run_dir)
        self.state_dir = self.run_dir / STATE_DIR
        self.keep_round_files = keep_round_files
        """Keep every round's tensors file (a replay from the genesis), instead of those after the older kept
        full state (`save`)."""
        self._restored_participation: tuple[tuple[float, ...], dict[int, dict[str, float]]] | None = None
        """The fragment shares and the `participation` counts `restore` tallied as it read the log, for the
        `participation` call that follows it (once)."""

    def restore(self, syncer: Syncer, *, repair: bool = True) -> Restored:
        """Bring a freshly built syncer (initial parameters) to the last committed round, and count each learner's
        rounds from the log (`participation`). Everything is checked before anything on disk changes: the log's lines
        (`RoundLog.numbered`, read one at a time: a long run's log is gigabytes), that it holds every round the state
        does, and the rounds replayed; a refused restore (a ValueError naming the file, the line or the round) leaves
        the run directory byte for byte as it was. Then, with `repair`, a torn last line is cut: it can only be the
        round after every state and every whole line (a state is written after its rounds are durable), one the
        syncer died appending and no learner heard of. `repair=False` for a reader that does not own the log (an
        export, a standby): a torn last line is then skipped, not cut."""
        restored = Restored()
        latest = load_latest_state(self.state_dir)
        if latest is not None:
            state, meta, _ = latest
            if "fragments" not in state:  # written before states recorded their plan: the round files name it
                difference = rounds_plan_difference(self.log, syncer.plan)
                if difference is not None:
                    raise plan_refusal(difference)
            syncer.load_state_dict(state)
            restored = Restored(state_rounds=syncer.rounds_committed, meta=meta, found_state=True)
        shares, counts = tuple(syncer.fragment_shares), {}
        held = 0
        for line in self._reading(self.log.numbered()):  # one line, and one round's tensors, in memory at a time
            held += 1
            count_participants(counts, line, shares)
            if line["round"] >= restored.state_rounds:
                replay_onto(syncer, [self.log.record(line)])
                restored.replayed += 1
        if held < restored.state_rounds:
            raise ValueError(self._shorter_than_state(held, restored.state_rounds))
        if repair:  # the owner, about to serve (a standby restores again and again: it would hold them meanwhile)
            self._restored_participation = shares, counts
            self.log.repair()
            for directory in (self.run_dir, self.log.tensor_dir, self.state_dir):
                remove_stale_temps(directory)  # what a syncer killed while writing left
        return restored

    def _shorter_than_state(self, held: int, state_rounds: int) -> str:
        """Why a log of `held` whole, gapless lines cannot continue a state of `state_rounds` rounds: its end is
        gone."""
        holds = f"holds rounds 0 to {held - 1}" if held else "holds no whole line"
        torn = self.log.torn_bytes()
        if torn:
            holds += f" and a torn last line ({torn} bytes)"
        lost = f"round {held} is" if state_rounds - held == 1 else f"rounds {held} to {state_rounds - 1} are"
        return (f"{self.log.path} {holds} but the syncer state in {self.state_dir} has {state_rounds}: {lost} missing "
                f"from its end; {LOG_DAMAGED}")

    def commit(self, record: RoundRecord) -> None:
        """Make one round durable (returns after the fsyncs)."""
        self.log.append(record)

    def save(self, syncer: Syncer, meta: dict[str, Any]) -> None:
        """Write the full state (serial = rounds committed); then, unless `keep_round_files`, remove the tensors
        files of the rounds before the older of the two states kept: a restart loads the newest state that reads
        back, or the one before it when the newest is damaged, and replays only the rounds after it. With one state
        only, nothing is removed: were it damaged, a restart would replay every round from the genesis."""
        save_state(self.state_dir, syncer.state_dict(), serial=syncer.rounds_committed, meta=meta)
        kept = state_files(self.state_dir)
        if not self.keep_round_files and len(kept) >= KEEP_STATES > 1:
            removed = self.log.prune_before(kept[0][0])
            if removed:
                logger.debug("[syncer] removed %d round files before round %d (held by the full state)", removed,
                             kept[0][0])

    def participation(self, shares: Sequence[float]) -> dict[int, dict[str, float]]:
        """Per learner, rounds it took part in and tokens merged, from the log (`merged_tokens`; `shares`: each
        fragment's share of the model, `FragmentPlan.shares`)."""
        # What a restore just counted, not a second read of the whole log (each pass 2.6 s at 100 k rounds of 2
        # learners, a probe).
        restored, self._restored_participation = self._restored_participation, None
        if restored is not None and restored[0] == tuple(shares):
            return restored[1]
        counts: dict[int, dict[str, float]] = {}
        for line in self._reading(self.log.numbered()):
            count_participants(counts, line, shares)
        return counts

    def _reading(self, lines: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """`lines` of the log, saying every READ_PROGRESS_EVERY_S how far the read is: at a syncer's start a long
        run's log takes a while (13 s per million rounds of 4 learners, `benchmarks/bench_round_log.py`)."""
        started = said = self.clock()
        size = self.log.size()
        for held, line in enumerate(lines, start=1):
            yield line
            now = self.clock()
            if now - said >= READ_PROGRESS_EVERY_S:
                said = now
                logger.warning("[syncer] reading the round log: %d rounds, %.0f of %.0f MB, %.0f s", held,
                               self.log.bytes_read / 1e6, size / 1e6, now - started)


def count_participants(counts: dict[int, dict[str, float]], line: Mapping[str, Any], shares: Sequence[float]) -> None:
    """Add one round log line's participants to `counts` (per learner: rounds it took part in, tokens merged)."""
    for p in line["participants"]:
        tally = counts.setdefault(int(p["learner_id"]), {"accepted": 0, "tokens_merged": 0.0})
        tally["accepted"] += 1
        tally["tokens_merged"] += merged_tokens(int(p["tokens"]), shares[int(line["fragment"])])


def merged_tokens(tokens: int, share: float) -> float:
    """The tokens of a participant's work that a round of one fragment merged: its tokens times the fragment's share
    of the model. Each of the P fragments' updates counts the same inner steps' tokens, so summed without the share a
    learner's merged tokens read P times what it trained."""
    return tokens * share
