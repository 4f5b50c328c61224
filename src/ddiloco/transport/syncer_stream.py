"""The syncer -> learner stream (Subscribe, Watch): Welcome, FragmentState, FragmentDelta and Rejected as chunks.

Framing as in `ddiloco.transport.grpc_codec`: a header chunk (a whole `Rejected` is one chunk), then the
tensors' bytes back to back in header order, starting in the header's own chunk. Welcome and FragmentState
carry raw float32 global values; FragmentDelta carries each tensor's change encoded by the downlink codec
(`ddiloco.downlink`). `SyncerStreamDecoder` checks everything against the `WireModel` before it becomes a
message: a header that disagrees with the model, the plan or the downlink codec is refused before its data
is read, the byte count exactly, the CRC32 of the bytes before anything is interpreted. It does not rebuild
a change (the learner does, and checks the rebuilt value's checksum). Problems raise `WireError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ddiloco.compression import get_codec
from ddiloco.messages import FragmentDelta, FragmentState, Rejected, RejectReason, SyncerMessage, Welcome
from ddiloco.transport import wire_pb2
from ddiloco.transport.grpc_codec import (
    CHUNK_BYTES,
    MAX_COUNTER,
    WIRE_DTYPE,
    WireError,
    WireModel,
    _float32_tensors,
    _Receiver,
    _with_first_data,
    check_crc32,
    check_crc32_of,
    crc32_of,
    field_wire_bytes,
    iter_data,
    tensor_bytes,
)
from ddiloco.zero_encodings import with_zeros

FLOAT32_NBYTES = 4


def _on_time(learner_ids: tuple[int, ...] | None, margins: tuple[float, ...] | None) -> wire_pb2.OnTime | None:
    return None if learner_ids is None else wire_pb2.OnTime(learner_ids=learner_ids, margins=margins or ())


def _read_on_time(header: wire_pb2.FragmentHeader | wire_pb2.FragmentDeltaHeader
                  ) -> tuple[tuple[int, ...] | None, tuple[float, ...] | None]:
    """The header's (on_time, margins); margins None unless there is one for each on-time learner."""
    if not header.HasField("on_time"):
        return None, None
    learner_ids = tuple(int(i) for i in header.on_time.learner_ids)
    margins = tuple(float(m) for m in header.on_time.margins)
    return learner_ids, margins if margins and len(margins) == len(learner_ids) else None


def _fragment_header(state: FragmentState) -> wire_pb2.FragmentHeader:
    return wire_pb2.FragmentHeader(fragment=state.fragment, version=state.version, tensors=[
        wire_pb2.TensorHeader(name=name, dtype=WIRE_DTYPE, shape=list(t.shape), nbytes=t.numel() * FLOAT32_NBYTES)
        for name, t in state.tensors.items()], crc32=crc32_of(tensor_bytes(t) for t in state.tensors.values()),
        on_time=_on_time(state.on_time, state.margins))


def _delta_header(delta: FragmentDelta) -> wire_pb2.FragmentDeltaHeader:
    # Name and byte length only: a change's shape is its parameter's, which the learner knows.
    return wire_pb2.FragmentDeltaHeader(
        fragment=delta.fragment, version=delta.version, base_version=delta.base_version, codec=delta.codec,
        tensors=[wire_pb2.TensorHeader(name=name, nbytes=len(data), zero=name in delta.zero)
                 for name, data in delta.payload.items()],
        crc32=crc32_of(delta.payload.values()), checksum=delta.checksum,
        on_time=_on_time(delta.on_time, delta.margins))


def encode_syncer_message(message: SyncerMessage, chunk_bytes: int = CHUNK_BYTES) -> Iterator[wire_pb2.SyncerChunk]:
    """The chunks of one syncer->learner message (Refused is not a stream message: it ends the
    Subscribe call with an error status). A FragmentDelta's changes of `zero` travel as their headers alone."""
    if isinstance(message, Rejected):
        yield wire_pb2.SyncerChunk(rejected=wire_pb2.RejectedMessage(
            learner_id=message.learner_id, fragment=message.fragment, base_version=message.base_version,
            reason=str(message.reason), detail=message.detail))
        return
    if isinstance(message, FragmentDelta):
        header = wire_pb2.SyncerChunk(fragment_delta=_delta_header(message))
        blobs: Iterator = (data for name, data in message.payload.items() if name not in message.zero)
    elif isinstance(message, FragmentState | Welcome):
        states: Sequence[FragmentState] = (message,) if isinstance(message, FragmentState) else message.fragments
        if isinstance(message, FragmentState):
            header = wire_pb2.SyncerChunk(fragment_state=_fragment_header(message))
        else:
            header = wire_pb2.SyncerChunk(welcome=wire_pb2.WelcomeHeader(
                learner_id=message.learner_id, config_fingerprint=message.config_fingerprint,
                fragments=[_fragment_header(s) for s in message.fragments]))
        blobs = (tensor_bytes(t) for s in states for t in s.tensors.values())
    else:
        raise TypeError(f"{type(message).__name__} does not travel on the subscription stream")
    yield from _with_first_data(header, iter_data(blobs, chunk_bytes), wire_pb2.SyncerChunk)


def _check_delta_header(model: WireModel, h: wire_pb2.FragmentDeltaHeader) -> None:
    if h.codec != model.downlink_codec_name:
        raise WireError(str(RejectReason.WRONG_CODEC), f"fragment change in codec {h.codec!r}, the learner "
                        f"expects {model.downlink_codec_name!r}")
    if not 1 <= h.version <= MAX_COUNTER or h.base_version != h.version - 1:
        raise WireError(str(RejectReason.BAD_COUNTERS), f"fragment change from version {h.base_version} to "
                        f"{h.version}: expected 1 <= version <= 2^53 and base_version = version - 1")
    model.check_fragment(h.fragment, [t.name for t in h.tensors])
    codec = get_codec(h.codec)
    specs = model.spec.by_name()
    for header in h.tensors:
        if header.dtype or header.shape:
            raise WireError(str(RejectReason.MALFORMED), f"the change of {header.name!r} declares a dtype or "
                            "shape: a change has its parameter's")
        expected = codec.encoded_nbytes(specs[header.name].numel)
        if header.nbytes != expected:
            raise WireError(str(RejectReason.MALFORMED), f"the change of {header.name!r} declares {header.nbytes} "
                            f"bytes, {h.codec} encodes its {specs[header.name].numel} values in {expected}")


class SyncerStreamDecoder:
    """Turns the chunks of a Subscribe stream back into messages, checking them against the model."""

    def __init__(self, model: WireModel) -> None:
        self.model = model
        self._header: wire_pb2.SyncerChunk | None = None
        self._receiver: _Receiver | None = None
        self.wire_bytes = 0
        """Serialised bytes of every chunk fed so far."""

    def _expect_data_for(self, chunk: wire_pb2.SyncerChunk) -> None:
        kind = chunk.WhichOneof("kind")
        if kind == "fragment_delta":
            _check_delta_header(self.model, chunk.fragment_delta)
            total = sum(t.nbytes for t in chunk.fragment_delta.tensors if not t.zero)
        else:
            fragments = [chunk.fragment_state] if kind == "fragment_state" else list(chunk.welcome.fragments)
            total = 0
            for frag in fragments:
                self.model.check_fragment(frag.fragment, [t.name for t in frag.tensors])
                for header in frag.tensors:
                    self.model.check_tensor(header, lambda numel: FLOAT32_NBYTES * numel)
                    total += header.nbytes
        self._header = chunk
        self._receiver = _Receiver(total)

    def feed(self, chunk: wire_pb2.SyncerChunk) -> SyncerMessage | None:
        """The message this chunk completes, or None while one is still arriving."""
        kind = chunk.WhichOneof("kind")
        data = chunk.data
        if kind is not None:
            if self._receiver is not None:
                self._receiver.require_complete()
            self.wire_bytes += field_wire_bytes(getattr(chunk, kind).ByteSize())
            if kind == "rejected":
                if data:
                    raise WireError("malformed", "a rejected message carries no data")
                return self._rejected(chunk.rejected)
            self._expect_data_for(chunk)
        elif not data:
            raise WireError("malformed", "an empty chunk")
        elif self._receiver is None:
            raise WireError("malformed", "a data chunk arrived without a header")
        if data:
            self.wire_bytes += field_wire_bytes(len(data))
            assert self._receiver is not None
            self._receiver.add(data)
        if self._receiver is None or not self._receiver.complete:
            return None
        return self._finish()

    @staticmethod
    def _rejected(r: wire_pb2.RejectedMessage) -> Rejected:
        try:
            reason = RejectReason(r.reason)
        except ValueError:
            raise WireError("malformed", f"unknown reject reason {r.reason!r}") from None
        return Rejected(int(r.learner_id), int(r.fragment), int(r.base_version), reason, r.detail)

    def _finish(self) -> SyncerMessage:
        assert self._header is not None and self._receiver is not None
        header, buffer = self._header, self._receiver.buffer
        self._header = self._receiver = None
        kind = header.WhichOneof("kind")
        if kind == "fragment_delta":
            h = header.fragment_delta
            specs = self.model.spec.by_name()
            payload = dict(with_zeros(get_codec(h.codec), [(t.name, t.zero, t.nbytes, specs[t.name].numel)
                                                           for t in h.tensors], buffer))
            check_crc32_of(payload.values(), h.crc32, f"the change of fragment {h.fragment} to version {h.version}")
            zero = frozenset(t.name for t in h.tensors if t.zero)
            return FragmentDelta(int(h.fragment), int(h.version), int(h.base_version), h.codec, payload,
                                 int(h.checksum), *_read_on_time(h), zero=zero)
        if kind == "fragment_state":
            frag = header.fragment_state
            check_crc32(buffer, frag.crc32, f"fragment {frag.fragment} version {frag.version}")
            tensors, _ = _float32_tensors(frag.tensors, buffer, 0)
            return FragmentState(int(frag.fragment), int(frag.version), tensors, *_read_on_time(frag))
        states, offset = [], 0
        for frag in header.welcome.fragments:
            end = offset + sum(t.nbytes for t in frag.tensors)
            check_crc32(memoryview(buffer)[offset:end], frag.crc32, f"the Welcome's fragment {frag.fragment}")
            tensors, offset = _float32_tensors(frag.tensors, buffer, offset)
            states.append(FragmentState(int(frag.fragment), int(frag.version), tensors))
        return Welcome(int(header.welcome.learner_id), tuple(states), header.welcome.config_fingerprint)
