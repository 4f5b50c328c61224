"""The messages learners and the syncer exchange, as plain data.

This is the only module the learner and syncer cores share. Transports turn these objects into
bytes (see `ddiloco.transport`); the cores never see a socket. Tensors inside messages are CPU
float32; pseudo-gradients travel already encoded by the configured codec (`Update.payload`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

SCHEMA_VERSION = 6
"""Bumped on any incompatible change to these messages or their wire encoding, and on a change a process of the
previous version would get around: 6 (2026-12-06) adds the run config the built-in learner declares at its join (a
learner of 5 declared none, so one with other settings could still become the run's genesis) and the built-in
evaluator at its watch, and the session every learner call names."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class ModelSpec:
    """Names, shapes and dtypes of a model's parameters: two parties can only merge equal specs."""

    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        # Specs are compared by name (`by_name`): a second entry for a name would vanish there unchecked.
        seen: set[str] = set()
        for spec in self.tensors:
            if spec.name in seen:
                raise ValueError(f"the model spec lists tensor {spec.name!r} twice: each parameter has one name")
            seen.add(spec.name)

    @classmethod
    def from_named_tensors(cls, named: Iterable[tuple[str, torch.Tensor]]) -> ModelSpec:
        return cls(tuple(TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                         for name, t in named))

    def in_dtype(self, dtype: str) -> ModelSpec:
        """The same names and shapes, every tensor in `dtype`."""
        return ModelSpec(tuple(TensorSpec(t.name, t.shape, dtype) for t in self.tensors))

    def by_name(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for spec in self.tensors}

    def difference(self, other: ModelSpec) -> str | None:
        """A human-readable description of the first mismatch, or None when equal."""
        mine, theirs = self.by_name(), other.by_name()
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        if missing:
            return f"parameter {missing[0]!r} is missing ({len(missing)} missing in all)"
        if extra:
            return f"unexpected parameter {extra[0]!r} ({len(extra)} unexpected in all)"
        for name, spec in mine.items():
            if spec != theirs[name]:
                return (f"parameter {name!r} is {theirs[name].dtype}{list(theirs[name].shape)}, "
                        f"expected {spec.dtype}{list(spec.shape)}")
        return None


class RejectReason(enum.StrEnum):
    """Why the syncer refused an update. Every update is either merged or rejected with one."""

    UNKNOWN_LEARNER = "unknown_learner"
    BAD_FRAGMENT = "bad_fragment"
    WRONG_TENSORS = "wrong_tensors"
    WRONG_CODEC = "wrong_codec"
    MALFORMED = "malformed"
    NON_FINITE = "non_finite"
    BAD_COUNTERS = "bad_counters"
    STALE = "stale"
    DUPLICATE = "duplicate"
    CORRUPT = "corrupt"
    """The payload's CRC32 does not match its header: bytes changed in flight (found on the wire)."""
    UNAVAILABLE = "unavailable"
    """The syncer cannot make rounds durable now (its disk is full or failing): nothing of the update was
    committed, and the learner's work since its base goes out again with its next update."""


# ---- learner -> syncer -------------------------------------------------------------------------

@dataclass(frozen=True)
class Join:
    """A learner asks to take part. `config_fingerprint` is `DilocoConfig.fingerprint()`."""

    learner_id: int
    model_spec: ModelSpec
    config_fingerprint: str
    schema_version: int = SCHEMA_VERSION
    embeddings: tuple[str, ...] = ()
    """The parameters the learner's model holds as embedding tables (`fragments.embedding_names`): the
    syncer of a new run takes them from its genesis join, to merge them by plain weighted mean."""
    aliases: tuple[tuple[str, str], ...] = ()
    """Tied weights: (alias, parameter name) for each other name under which the model's state_dict holds
    a parameter; kept with the genesis so that `ddiloco export` writes every key the model loads."""
    max_tokens_per_step: int = 0
    """The most tokens (or samples) one inner step of this learner counts, as it declares it: its updates may
    carry at most steps x this many tokens. 0: not declared, the run's `QuorumConfig.max_tokens_per_step`
    applies; more than that is refused."""
    buffers: tuple[str, ...] = ()
    """The names of the model's persistent buffers (`ddiloco.model_buffers`): an --init file may hold them beside
    the parameters (an export of a model with buffers does); they are not taken from it."""
    run_config: Mapping[str, Any] | None = None
    """The run config (`RunConfig.to_dict()`) the learner's model and data were built from, where it declares one
    (the built-in learner): the syncer refuses a join whose settings differ from its run's. None for a script."""


@dataclass(frozen=True)
class DecodedTensor:
    """One tensor of an update, decoded once and checked: float32 values, all finite, and their L2 norm."""

    values: torch.Tensor
    """The values; with the compiled kernels an int4 payload's stay where they lie (`ddiloco.kernels.Int4Blocks`, flat),
    decoded as the round's sums add them."""
    norm: float
    """||values||_2, computed in float64 (finite: a float32 value squared cannot overflow a float64)."""


@dataclass(frozen=True)
class Update:
    """A learner's pseudo-gradient for one fragment: base - local, encoded per tensor."""

    learner_id: int
    fragment: int
    base_version: int
    """The fragment version the pseudo-gradient is measured from."""
    inner_step: int
    """The learner's inner step count when it published."""
    steps: int
    """Inner steps trained on this fragment since the learner last received it."""
    tokens: int
    """Tokens trained on this fragment since the learner last received it."""
    codec: str
    payload: Mapping[str, bytes]
    """Tensor name -> encoded pseudo-gradient bytes."""
    final: bool = False
    """The learner's last work before it leaves (`Learner.flush`): like a late update, it rides in a
    round without making one, so learners finishing together are merged in one round."""
    step_time_s: float | None = None
    """Seconds the learner's inner steps took since its previous update, per step, its waits for results left out (its
    driver times them: `LearnerSession.step`); None where nothing timed them (the harness). The syncer's step time is
    made of these where they are given (`Syncer._observe_step_time`): the spacing of updates counts those waits, which
    a long link makes long."""
    result_delay_s: float | None = None
    """Seconds from the learner's previous update of this fragment to the arrival of its round's result, the version
    this update is based on, on the learner's clock (its driver times them: `SessionMessages`); None where not timed.
    Less the time the syncer held that update, it is the path the syncer does not see (the upload, the download,
    latency both ways), of which the adaptive grace window leaves room (`Syncer._observe_path_time`)."""
    decoded: Mapping[str, DecodedTensor] | None = field(default=None, repr=False, compare=False)
    """The payload already decoded and checked by the wire layer (`ddiloco.update_values.decode_payload`), outside
    the syncer's lock; None: the syncer core decodes it. Never sent: the wire carries `payload`. The values may sit
    in reused buffers: the core reads them during `Syncer.receive` and keeps no reference to them."""
    zero: frozenset[str] = field(default=frozenset(), compare=False)
    """The tensors whose bytes the wire layer found to be their codec's encoding of zeros (a frozen parameter's): they
    travelled as their headers alone (`ddiloco.zero_encodings`). Empty until the update has been on the wire."""

    @property
    def payload_bytes(self) -> int:
        """The payload's bytes that travel (not the zero tensors')."""
        return sum(len(data) for name, data in self.payload.items() if name not in self.zero)


@dataclass(frozen=True)
class Heartbeat:
    learner_id: int
    inner_step: int


@dataclass(frozen=True)
class Leave:
    learner_id: int


# ---- syncer -> learner -------------------------------------------------------------------------

@dataclass(frozen=True)
class FragmentState:
    """The global value of one fragment at `version` (float32, exact): what a join, a stale update's
    catch-up and a round broadcast with `downlink_codec="fp32"` carry."""

    fragment: int
    version: int
    tensors: Mapping[str, torch.Tensor]
    on_time: tuple[int, ...] | None = None
    """A round broadcast's: the learners whose update from `version - 1` the round merged (see
    `FragmentDelta.on_time`); None in a join's or a catch-up's state."""
    margins: tuple[float, ...] | None = None
    """A round broadcast's: see `FragmentDelta.margins`."""

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class FragmentDelta:
    """A new version of one fragment as its change since `base_version`, encoded per tensor by the downlink
    codec. The new global value is the learner's fragment at `base_version` plus the decoded change;
    `checksum` is that value's checksum (`ddiloco.downlink`), so a learner that rebuilt anything else knows
    it and fetches the full fragment again."""

    fragment: int
    version: int
    base_version: int
    """The version the change applies to (version - 1)."""
    codec: str
    payload: Mapping[str, bytes | memoryview]
    """Tensor name -> the encoded change (read-only: the syncer's fused close hands out views of its buffers)."""
    checksum: int
    """zlib.crc32 of the new global value's float32 bytes, tensor by tensor in the fragment plan's order."""
    on_time: tuple[int, ...] | None = None
    """The learners, ascending, whose update published from `base_version` the round merged: a learner that
    published for this round and is not named reached it after the close, so its clock runs behind the round's
    (`Learner._follow_close`). None: not known."""
    margins: tuple[float, ...] | None = None
    """For each learner of `on_time`, in its order: the inner steps of its own (at its step time as the syncer
    measures it) that were left of the round's grace window when its update arrived, 0 at or after its end: a
    learner with little left moves its schedule ahead before it is late (`Learner._follow_close`). None: not
    known (no window yet)."""
    zero: frozenset[str] = field(default=frozenset(), compare=False)
    """The tensors whose change is exactly zero, their bytes being the codec's encoding of zeros (a frozen
    parameter's): they travel as their headers alone (`ddiloco.zero_encodings`)."""

    @property
    def payload_bytes(self) -> int:
        """The payload's bytes that travel (not the zero tensors')."""
        return sum(len(data) for name, data in self.payload.items() if name not in self.zero)


@dataclass(frozen=True)
class Welcome:
    """Accepts a join and carries the whole current global model, one state per fragment."""

    learner_id: int
    fragments: tuple[FragmentState, ...]
    config_fingerprint: str


@dataclass(frozen=True)
class Refused:
    """A join refused; `reason` names the mismatch. The learner must not train."""

    learner_id: int
    reason: str
    another_process: bool = False
    """Refused because another process holds this learner id (it replaced this one, or this one is the second): the
    learner's checkpoint is that process's to write."""


@dataclass(frozen=True)
class Rejected:
    """An update that was not merged, and why. UNKNOWN_LEARNER asks the learner to join again."""

    learner_id: int
    fragment: int
    base_version: int
    reason: RejectReason
    detail: str = ""
    inner_step: int = -1
    """The rejected update's inner step, where the learner's side knows it (its transport, the in-process syncer); -1
    where not (not on the wire). It tells an update from a later one of the same fragment and base."""


@dataclass(frozen=True)
class Undelivered:
    """Not a wire message: the learner's own transport could not deliver its update (`fragment`, published at
    `inner_step` from `base_version`) to the syncer (unreachable, a partition): no round result is owed for it."""

    learner_id: int
    fragment: int
    base_version: int
    inner_step: int


LearnerMessage = Join | Update | Heartbeat | Leave
SyncerMessage = FragmentState | FragmentDelta | Welcome | Refused | Rejected | Undelivered


@dataclass(frozen=True)
class Send:
    """Syncer action: deliver `message` to `learner_id`."""

    learner_id: int
    message: SyncerMessage


@dataclass(frozen=True)
class Participant:
    learner_id: int
    base_version: int
    staleness: int
    steps: int
    tokens: int
    weight: float
    inner_step: int = -1
    """The learner's inner step when it published this update (-1 in round logs written before it was
    recorded); with learner_id and the round's fragment it names the update in the learner's work ledger."""
    folded: tuple[tuple[int, int], ...] = ()
    """(base_version, inner_step) of this learner's earlier updates that this participant includes: a late
    update held in the round and combined with its newer one, or replaced by the same work continued."""


@dataclass(frozen=True)
class RoundRecord:
    """One committed round: enough to audit it and to replay the global state bit for bit."""

    round_index: int
    fragment: int
    version: int
    """The fragment version this round produced."""
    participants: tuple[Participant, ...]
    merged: Mapping[str, torch.Tensor] = field(repr=False)
    """The merged pseudo-gradient fed to the outer optimizer (float32)."""
    opened_at: float
    quorum_at: float
    closed_at: float
    grace_s: float
    rejections: tuple[tuple[int, str], ...] = ()
    """(learner_id, reason) of updates for this fragment rejected while the round was open."""
    summed: tuple[int, ...] = ()
    """The participants' learner ids in the order their updates were summed into `merged` (arrival order,
    `ddiloco.round_sum`); empty in round logs written before it was recorded."""

    def to_json(self) -> dict:
        return {
            "round": self.round_index, "fragment": self.fragment, "version": self.version,
            "participants": [dataclasses.asdict(p) for p in self.participants],
            "opened_at": self.opened_at, "quorum_at": self.quorum_at, "closed_at": self.closed_at,
            "grace_s": self.grace_s, "rejections": [list(r) for r in self.rejections], "summed": list(self.summed),
        }


@dataclass(frozen=True)
class Commit:
    """Syncer action: round `record` is committed. A syncer with a journal (`ddiloco.round_journal.Journal`, the
    runtime's round log) made it durable before changing any state, so no learner ever holds a version that a
    restart could lose; drivers without one (the simulator, the in-process hub) keep it as they like."""

    record: RoundRecord
    capped: tuple[int, ...] = ()
    """The learners whose update counted with a smaller norm in this round (`QuorumConfig.max_norm_ratio`)."""


SyncerAction = Send | Commit
