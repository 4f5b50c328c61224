"""ddiloco messages <-> the protobuf wire schema (wire.proto), in chunks of about 1 MiB: joins, updates, the
framing every message with tensors shares, and `WireModel`, what a well-formed message looks like. The
syncer -> learner stream (Welcome, FragmentState, FragmentDelta, Rejected) is `ddiloco.transport.syncer_stream`.

A message with tensors travels as one header chunk (names, dtypes, shapes and byte lengths) followed
by data chunks that hold the tensors' bytes back to back in header order; a message without tensors
(`Rejected`) is one chunk. Tensors are raw little-endian bytes: float32 global values or changes encoded
by the downlink codec on the downlink, codec-encoded pseudo-gradients on the uplink. No pickle anywhere.

Everything read off the wire is checked here before it becomes a message: `WireModel` knows the
model's tensor names, shapes and dtypes, the fragment plan and the codec, so a header that
disagrees is refused before its data is read, a stream that carries more bytes than its header
declared is refused at the first extra byte, one that ends early is refused as truncated, and one
whose bytes do not match the CRC32 in its header is refused as corrupt (checked before decoding, so
a changed byte is never mistaken for a malformed or non-finite payload). No memory is taken for a message's data
before its first byte arrives, so a server can check who sent a header before it costs anything
(`UpdateAssembler.check_header`, then `add_data`). A join's config JSON is bounded in
length and nesting before it is parsed, and its integers while it is parsed (`decode_config`).
Problems raise `WireError(reason, detail, status)`; the gRPC server turns it into an error status
and a recorded rejection.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DEFAULT_DOWNLINK_CODEC, DilocoConfig
from ddiloco.fragments import FragmentPlan
from ddiloco.messages import (
    Join,
    ModelSpec,
    RejectReason,
    TensorSpec,
    Update,
)
from ddiloco.transport import wire_pb2
from ddiloco.update_values import DecodeBuffers, decode_payload, reads_in_place
from ddiloco.zero_encodings import with_zeros, zero_names

CHUNK_BYTES = 1 << 20
"""Data bytes per chunk: large enough that per-chunk overhead is negligible (gRPC measured 0.6 GB/s
on loopback with 1 MiB chunks, docs/architecture.md), small enough to stay far below message-size limits."""
MAX_CHUNK_BYTES = 4 * CHUNK_BYTES
"""A data chunk larger than this is refused (our own senders never exceed CHUNK_BYTES)."""
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)
"""gRPC's per-message limit on both ends: one chunk plus room for a header of a large model."""
MAX_COUNTER = 2**53
"""Counters (steps, tokens, versions) beyond this are nonsense and refused (exact in a float64)."""
MAX_LEARNER_ID = 2**31 - 1
MAX_CONFIG_JSON_CHARS = 1 << 14
"""A join's config JSON longer than this is refused unparsed (a DilocoConfig's is about 250 characters)."""
MAX_CONFIG_JSON_DEPTH = 8
"""Nesting deeper than this is refused before parsing: the config is one flat object, and Python's json decoder
recurses once per level (200,000 levels raise RecursionError)."""
MAX_CONFIG_INT_DIGITS = 20
"""A longer integer in a join's config is refused as it is parsed: every counter fits in 16 digits (MAX_COUNTER),
and int() raises ValueError past 4,300."""
MAX_SHOWN_CHARS = 80
"""A learner's config value quoted in a refusal is cut to this many characters."""
MAX_DETAIL_CHARS = 500
"""A refusal's detail is cut to this many characters: it may quote the peer's input (a tensor name of megabytes), and
it travels in a gRPC status, whose metadata a client refuses past 16 KiB, and into a log line and an event."""
WIRE_DTYPE = "float32"
"""The dtype of every tensor on the wire: global values, and pseudo-gradients once decoded."""

if sys.byteorder != "little":  # raw tensor bytes are little-endian by contract
    raise ImportError("ddiloco's gRPC transport needs a little-endian machine")


class WireError(Exception):
    """Bad input on the wire. `reason` is a short tag (a RejectReason value, or unauthenticated,
    bad_schema, truncated, oversize, refused), `detail` says exactly what is wrong."""

    def __init__(self, reason: str, detail: str, status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        detail = shortened(detail)
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status


# ---- specs -----------------------------------------------------------------------------------------

def spec_to_headers(spec: ModelSpec) -> list[wire_pb2.TensorHeader]:
    return [wire_pb2.TensorHeader(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in spec.tensors]


def headers_to_spec(headers: Iterable[wire_pb2.TensorHeader]) -> ModelSpec:
    return ModelSpec(tuple(TensorSpec(h.name, tuple(int(d) for d in h.shape), h.dtype) for h in headers))


def config_difference(mine: DilocoConfig, theirs: Mapping[str, object]) -> str | None:
    """The first algorithm setting on which a learner's config (as a dict) differs, or None."""
    ours = mine.to_dict()
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            shown = name if name in ours else _shown(name)
            return f"{shown} is {_shown(theirs.get(name))} on the learner but {ours.get(name)!r} on the syncer"
    return None


def _shown(value: object) -> str:
    """repr(value) (which also escapes what UTF-8 cannot carry), cut to MAX_SHOWN_CHARS."""
    return shortened(repr(value), MAX_SHOWN_CHARS)


def shortened(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text`, cut to `limit` characters and saying so."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# ---- join --------------------------------------------------------------------------------------------

def encode_join(join: Join, config: DilocoConfig) -> wire_pb2.JoinRequest:
    return wire_pb2.JoinRequest(
        learner_id=join.learner_id, schema_version=join.schema_version,
        config_fingerprint=join.config_fingerprint, diloco_config_json=json.dumps(config.to_dict(), sort_keys=True),
        model_spec=spec_to_headers(join.model_spec), embeddings=list(join.embeddings),
        aliases=[f"{alias}={name}" for alias, name in join.aliases], max_tokens_per_step=join.max_tokens_per_step,
        buffers=list(join.buffers),
        run_config_json="" if join.run_config is None else json.dumps(dict(join.run_config), sort_keys=True))


def decode_join(request: wire_pb2.JoinRequest) -> tuple[Join, dict]:
    """The Join and the learner's algorithm config (a dict), or WireError."""
    if not 0 <= request.learner_id <= MAX_LEARNER_ID:
        raise WireError("refused", f"learner_id={request.learner_id} is invalid: expected 0..{MAX_LEARNER_ID}",
                        grpc.StatusCode.INVALID_ARGUMENT)
    config = decode_config(request.diloco_config_json)
    try:
        spec = headers_to_spec(request.model_spec)
    except ValueError as exc:  # ModelSpec's own check: a tensor listed twice
        raise WireError("malformed", str(exc)) from None
    names = {t.name for t in spec.tensors}
    unknown = sorted(set(request.embeddings) - names)
    if unknown:
        raise WireError("malformed", f"embedding {unknown[0]!r} is not a parameter of the join's model")
    # max_tokens_per_step is passed as sent: the syncer core refuses a negative one, or one above the run's limit.
    join = Join(int(request.learner_id), spec, request.config_fingerprint, int(request.schema_version),
                embeddings=tuple(sorted(set(request.embeddings))), aliases=decode_aliases(request.aliases, names),
                max_tokens_per_step=int(request.max_tokens_per_step), buffers=tuple(sorted(set(request.buffers))),
                run_config=decode_config(request.run_config_json, "run_config_json") or None)
    return join, config


def decode_config(text: str, field: str = "diloco_config_json") -> dict:
    """A join's algorithm config (a dict) from its JSON (or its run config, `field`), or WireError. The text is bounded
    before it is parsed (length, nesting) and its integers while it is parsed, so no input makes the decoder raise
    anything else."""
    if not text:
        return {}
    if len(text) > MAX_CONFIG_JSON_CHARS:
        raise WireError("malformed", f"{field} has {len(text)} characters: at most {MAX_CONFIG_JSON_CHARS}")
    if json_nests_deeper(text, MAX_CONFIG_JSON_DEPTH):
        raise WireError("malformed", f"{field} is nested more than {MAX_CONFIG_JSON_DEPTH} deep")
    try:
        config = json.loads(text, parse_int=_config_int)
    except json.JSONDecodeError as exc:
        raise WireError("malformed", f"{field} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise WireError("malformed", f"{field} must be a JSON object")
    return config


def _config_int(digits: str) -> int:
    count = len(digits.lstrip("-"))
    if count > MAX_CONFIG_INT_DIGITS:
        raise WireError("malformed", f"a join's config holds an integer of {count} digits: at most "
                        f"{MAX_CONFIG_INT_DIGITS}")
    return int(digits)


_JSON_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
"""A JSON string, or a bracket outside strings. The closing quote is optional, so a match never fails halfway and
the scan stays linear (an unclosed string runs to the end of the text, which the decoder refuses anyway)."""


def json_nests_deeper(text: str, limit: int) -> bool:
    """Whether the arrays and objects of `text` nest deeper than `limit`, found without parsing it."""
    if text.count("[") + text.count("{") <= limit:
        return False  # every config the learner writes: one brace
    depth = 0
    for match in _JSON_STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > limit:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


def decode_aliases(pairs: Iterable[str], names: set[str]) -> tuple[tuple[str, str], ...]:
    """ "ALIAS=NAME" strings -> (alias, name) pairs, each NAME a parameter and no ALIAS one; or WireError. Names may
    hold "=" themselves (a ModuleDict key "lang=en"), so a pair is split at the one "=" that leaves a parameter on
    its right and a non-empty name that is no parameter on its left; a pair with two such readings is refused."""
    out = []
    for pair in pairs:
        readings = [(pair[:at], pair[at + 1:]) for at, char in enumerate(pair) if char == "="]
        fits = [(alias, name) for alias, name in readings if alias and name in names and alias not in names]
        if not fits:
            raise WireError("malformed", f"alias {pair!r}: expected ALIAS=PARAMETER for a parameter of the model")
        if len(fits) > 1:
            raise WireError("malformed", f"alias {pair!r} can be read two ways ({fits[0][0]!r} of {fits[0][1]!r}, "
                                         f"{fits[1][0]!r} of {fits[1][1]!r}): rename one of those parameters")
        out.append(fits[0])
    return tuple(sorted(set(out)))


# ---- data chunks ---------------------------------------------------------------------------------------

def iter_data(blobs: Iterable[bytes | memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The concatenation of `blobs`, cut into chunks of `chunk_bytes` (the last may be shorter).
    Small blobs are packed together; large ones are sliced without joining everything first (a
    fresh buffer the size of a large tensor costs more in page faults than the copy itself)."""
    pending = bytearray()
    for blob in blobs:
        view = memoryview(blob)
        if pending:
            take = min(chunk_bytes - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) == chunk_bytes:
                yield bytes(pending)
                pending = bytearray()
        while len(view) >= chunk_bytes:
            yield bytes(view[:chunk_bytes])
            view = view[chunk_bytes:]
        pending += view
    if pending:
        yield bytes(pending)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw little-endian float32 bytes of a tensor (C order), without a copy when the tensor is
    already a contiguous float32 CPU tensor. The caller must not modify the tensor meanwhile."""
    flat = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    return memoryview(flat.numpy()).cast("B")


def crc32_of(blobs: Iterable[bytes | memoryview | bytearray]) -> int:
    """zlib.crc32 of the concatenation of `blobs` (the `crc32` field of every header with tensors)."""
    crc = 0
    for blob in blobs:
        crc = zlib.crc32(blob, crc)
    return crc


def check_crc32(data: bytes | memoryview | bytearray, expected: int, what: str) -> None:
    check_crc32_of((data,), expected, what)


def check_crc32_of(blobs: Iterable[bytes | memoryview | bytearray], expected: int, what: str) -> None:
    """The CRC32 of `blobs`' bytes back to back is `expected`, else the message is refused as corrupt."""
    blobs = list(blobs)
    actual = crc32_of(blobs)
    if actual != expected:
        nbytes = sum(memoryview(blob).nbytes for blob in blobs)
        raise WireError(str(RejectReason.CORRUPT), f"{what}: CRC32 of its {nbytes} tensor bytes is "
                        f"{actual:#010x}, the header says {expected:#010x} (bytes changed in flight)")


def flip_data_byte(chunk) -> bool:
    """Corrupt a chunk's tensor data in place, leaving its header intact: the middle byte of `data`
    is inverted. False (nothing changed) when the chunk carries no data. For chaos tests."""
    if not chunk.data:
        return False
    data = bytearray(chunk.data)
    data[len(data) // 2] ^= 0xFF
    chunk.data = bytes(data)
    return True


def field_wire_bytes(nbytes: int) -> int:
    """Serialised size of a length-delimited field (field number < 16) of `nbytes`: tag, varint, bytes."""
    return 1 + max(1, (nbytes.bit_length() + 6) // 7) + nbytes


def _with_first_data(header_chunk, data: Iterator[bytes], cls) -> Iterator:
    """The header chunk carrying the first data chunk (one gRPC message for a small tensor set),
    then the remaining data chunks."""
    first = next(data, b"")
    if first:
        header_chunk.data = first
    yield header_chunk
    for chunk in data:
        yield cls(data=chunk)


class _Receiver:
    """Collects the data chunks of one message into one buffer, allocated when the first byte arrives (a header
    alone, or one refused before its data is read, costs nothing). The buffer has the declared size at once, or
    with `grow` grows with the bytes: for a message whose size is only its sender's claim (a genesis), so that
    memory follows what was actually sent. Memory that cannot be had is a refusal (`oversize`), not a MemoryError."""

    def __init__(self, expected_bytes: int, *, grow: bool = False) -> None:
        self.expected_bytes = expected_bytes
        self.buffer = bytearray()
        self.received = 0
        self._grow = grow

    def add(self, data: bytes) -> None:
        if len(data) > MAX_CHUNK_BYTES:
            raise WireError("oversize", f"a data chunk of {len(data)} bytes exceeds the limit of {MAX_CHUNK_BYTES}",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)
        end = self.received + len(data)
        if end > self.expected_bytes:
            raise WireError("oversize", f"the stream carries more than the {self.expected_bytes} bytes its "
                            "header declared", grpc.StatusCode.RESOURCE_EXHAUSTED)
        if not data:
            return
        try:
            if not self._grow and not self.buffer:
                self.buffer = bytearray(self.expected_bytes)
            self.buffer[self.received:end] = data  # past the end of a growing buffer: appended
        except MemoryError:
            raise WireError("oversize", f"no memory for the {self.expected_bytes} bytes its header declared (after "
                            f"{self.received})", grpc.StatusCode.RESOURCE_EXHAUSTED) from None
        self.received = end

    @property
    def complete(self) -> bool:
        return self.received == self.expected_bytes

    def require_complete(self) -> None:
        if not self.complete:
            raise WireError("truncated", f"the stream ended after {self.received} of the "
                            f"{self.expected_bytes} bytes its header declared")


# ---- checking what arrives ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class WireModel:
    """What a well-formed message must look like for one model, plan and codecs."""

    spec: ModelSpec
    plan: FragmentPlan
    codec_name: str
    """The uplink codec (`DilocoConfig.codec`)."""
    downlink_codec_name: str = DEFAULT_DOWNLINK_CODEC
    """The codec of fragment changes (`DilocoConfig.downlink_codec`)."""

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorSpec]:
        return self.spec.by_name()

    def check_tensor(self, header: wire_pb2.TensorHeader, expected_nbytes_of) -> TensorSpec:
        spec = self._by_name.get(header.name)
        if spec is None:
            raise WireError(str(RejectReason.WRONG_TENSORS), f"unknown tensor {header.name!r}")
        if header.dtype != spec.dtype:
            raise WireError(str(RejectReason.MALFORMED),
                            f"tensor {header.name!r} has dtype {header.dtype!r}, the model's is {spec.dtype!r}")
        shape = tuple(int(d) for d in header.shape)
        if shape != spec.shape:
            raise WireError(str(RejectReason.WRONG_TENSORS),
                            f"tensor {header.name!r} has shape {list(shape)}, the model's is {list(spec.shape)}")
        expected = expected_nbytes_of(spec.numel)
        if header.nbytes > expected:
            raise WireError("oversize", f"tensor {header.name!r} declares {header.nbytes} bytes, at most "
                            f"{expected} are possible", grpc.StatusCode.RESOURCE_EXHAUSTED)
        if header.nbytes != expected:
            raise WireError(str(RejectReason.MALFORMED),
                            f"tensor {header.name!r} declares {header.nbytes} bytes, expected {expected}")
        return spec

    def check_fragment(self, fragment: int, names: Sequence[str]) -> None:
        if not 0 <= fragment < self.plan.num_fragments:
            raise WireError(str(RejectReason.BAD_FRAGMENT),
                            f"fragment {fragment} outside 0..{self.plan.num_fragments - 1}")
        expected = self.plan.fragments[fragment]
        if len(set(names)) != len(names) or sorted(names) != sorted(expected):
            raise WireError(str(RejectReason.WRONG_TENSORS),
                            f"fragment {fragment} holds tensors {sorted(expected)}, got {sorted(names)}")


def _float32_tensors(headers: Sequence[wire_pb2.TensorHeader], buffer: bytearray,
                     offset: int) -> tuple[dict[str, torch.Tensor], int]:
    tensors = {}
    for header in headers:
        numel = math.prod(header.shape)
        tensors[header.name] = (torch.frombuffer(buffer, dtype=torch.float32, count=numel, offset=offset)
                                if numel else torch.zeros(0)).view(tuple(header.shape))  # frombuffer refuses count 0
        offset += header.nbytes
    return tensors, offset


# ---- learner -> syncer updates ------------------------------------------------------------------------------

def encode_update(update: Update, spec: ModelSpec, chunk_bytes: int = CHUNK_BYTES) -> Iterator[wire_pb2.UpdateChunk]:
    """The chunks of `update`; a tensor whose bytes encode zeros (a frozen parameter's) travels as its header alone
    (`ddiloco.zero_encodings`)."""
    shapes = spec.by_name()
    names = list(update.payload)
    zero = zero_names(get_codec(update.codec), update.payload, {n: shapes[n].numel for n in names})
    header = wire_pb2.UpdateChunk(header=wire_pb2.UpdateHeader(
        learner_id=update.learner_id, fragment=update.fragment, base_version=update.base_version,
        inner_step=update.inner_step, steps=update.steps, tokens=update.tokens, codec=update.codec,
        final=update.final, step_time_s=update.step_time_s or 0.0, result_delay_s=update.result_delay_s or 0.0,
        tensors=[wire_pb2.TensorHeader(name=n, dtype=shapes[n].dtype, shape=list(shapes[n].shape),
                                       nbytes=len(update.payload[n]), zero=n in zero) for n in names],
        crc32=crc32_of(update.payload[n] for n in names)))
    yield from _with_first_data(header, iter_data((update.payload[n] for n in names if n not in zero), chunk_bytes),
                                wire_pb2.UpdateChunk)


def _check_counters(h: wire_pb2.UpdateHeader) -> None:
    values = {"base_version": h.base_version, "inner_step": h.inner_step, "steps": h.steps, "tokens": h.tokens}
    for name, value in values.items():
        if not 0 <= value <= MAX_COUNTER:
            raise WireError(str(RejectReason.BAD_COUNTERS), f"{name}={value} is outside 0..2^53")
    for name, seconds in (("step_time_s", h.step_time_s), ("result_delay_s", h.result_delay_s)):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise WireError(str(RejectReason.BAD_COUNTERS), f"{name}={seconds}: expected seconds >= 0")
    if h.steps < 1 or h.inner_step < h.steps:
        raise WireError(str(RejectReason.BAD_COUNTERS),
                        f"steps={h.steps} inner_step={h.inner_step}: expected 1 <= steps <= inner_step")


class UpdateAssembler:
    """Reassembles one PushUpdate stream into an `Update`, validating as it goes."""

    def __init__(self, model: WireModel, *, buffers: DecodeBuffers | None = None) -> None:
        """`buffers`: where `finish` decodes into (given back by `release`); none: new tensors."""
        self.model = model
        self._codec = get_codec(model.codec_name)
        self.header: wire_pb2.UpdateHeader | None = None
        self._receiver: _Receiver | None = None
        self._buffers = buffers
        self._taken: list[torch.Tensor] = []

    def start(self, chunk: wire_pb2.UpdateChunk) -> wire_pb2.UpdateHeader:
        """Check the first chunk's header before any data is read, then take the chunk's data."""
        h = self.check_header(chunk)
        self.add_data(chunk.data)
        return h

    def check_header(self, chunk: wire_pb2.UpdateChunk) -> wire_pb2.UpdateHeader:
        """Check the first chunk's header, taking none of its data and allocating nothing: the server checks who
        sent it before `add_data` takes the first chunk's data."""
        if not chunk.HasField("header"):
            raise WireError("malformed", "the first chunk of an update must hold its header")
        h = chunk.header
        if not 0 <= h.learner_id <= MAX_LEARNER_ID:
            raise WireError(str(RejectReason.UNKNOWN_LEARNER), f"learner_id={h.learner_id} is invalid")
        if h.codec != self.model.codec_name:
            raise WireError(str(RejectReason.WRONG_CODEC), f"codec {h.codec!r}, the syncer expects "
                            f"{self.model.codec_name!r}")
        self.model.check_fragment(h.fragment, [t.name for t in h.tensors])
        for header in h.tensors:
            self.model.check_tensor(header, self._codec.encoded_nbytes)
        _check_counters(h)
        self.header = h
        self._receiver = _Receiver(sum(t.nbytes for t in h.tensors if not t.zero))
        return h

    def add(self, chunk: wire_pb2.UpdateChunk) -> None:
        if chunk.HasField("header"):
            raise WireError("malformed", "a second header inside one update stream")
        self.add_data(chunk.data)

    def add_data(self, data: bytes) -> None:
        assert self._receiver is not None, "check_header() first"
        self._receiver.add(data)

    def finish(self) -> Update:
        """The update, once the stream has ended, decoded and checked (`Update.decoded`: the syncer core does not
        decode it again; with `buffers`, valid until `release`); its payload decodes to finite values."""
        assert self.header is not None and self._receiver is not None, "start() first"
        self._receiver.require_complete()
        h = self.header
        payload = dict(with_zeros(self._codec, [(t.name, t.zero, t.nbytes, math.prod(t.shape)) for t in h.tensors],
                                  self._receiver.buffer))
        check_crc32_of(payload.values(), h.crc32, f"update of learner {h.learner_id} for fragment {h.fragment}")
        if self._buffers is not None and not reads_in_place(self._codec):
            self._taken = [self._buffers.take(self._codec.buffer_numel(math.prod(t.shape))) for t in h.tensors]
        decoded = decode_payload(self._codec, payload, list(payload), {t.name: tuple(t.shape) for t in h.tensors},
                                 into=self._taken)
        if isinstance(decoded, tuple):
            self.release()
            reason, detail = decoded
            raise WireError(str(reason), f"tensor {detail}")
        return Update(int(h.learner_id), int(h.fragment), int(h.base_version), int(h.inner_step), int(h.steps),
                      int(h.tokens), h.codec, payload, final=bool(h.final), step_time_s=h.step_time_s or None,
                      result_delay_s=h.result_delay_s or None, decoded=decoded,
                      zero=frozenset(t.name for t in h.tensors if t.zero))

    def release(self) -> None:
        """Done with this update (the syncer core has taken it, or it was refused): the decode buffers go back and
        the received bytes are let go (an `Update` from `finish` keeps its payload's). Not while `finish` runs."""
        if self._buffers is not None and self._taken:
            self._buffers.give(self._taken)
        self._taken = []
        self._receiver = None
