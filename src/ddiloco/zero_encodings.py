"""Tensors that travel as their header alone on the wire: those whose encoded bytes are their codec's encoding of zeros.

A frozen parameter (`requires_grad=False`, a LoRA model's base weights) has a pseudo-gradient of exactly zero in every
update and, its merged value being zero, a change of exactly zero in every downlink delta. Its encoded bytes are then
the codec's encoding of zeros (`Codec.zero_layout`: zero scales, then one repeated byte), which the receiver can write
itself. The syncer finds them as it encodes a round's change (`FragmentDelta.zero`, so that its byte counts leave them
out), a learner's wire layer as it sends an update (`Update.zero` on the syncer's side). Such a tensor's
`TensorHeader` (wire.proto) says `zero`; its `nbytes` still gives the encoded length, no bytes of it follow
in `data`, and the receiver puts them back before it checks the message's CRC32, which covers every tensor's bytes as
before: what is decoded is bit for bit what was encoded, the bytes that travel are fewer.

The test is on the bytes, never on values: a tensor counts as zero only where its encoding is exactly the one of
zeros (a -0.0 in fp32, or a block whose scale underflowed, is sent as it is). A tensor that is not zero is told apart
by a few sampled bytes (its first scale, almost always), so the test costs nothing measurable on a trained tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ddiloco.codec_interface import Codec

SAMPLES = 64
"""Bytes sampled, evenly spread, before a whole payload is read."""
CHECK_BYTES = 1 << 20
"""A payload that passed the samples is read in pieces of this many bytes (no temporary the payload's size)."""


def encodes_zeros(codec: Codec, numel: int, data: bytes | bytearray | memoryview) -> bool:
    """Whether `data` is exactly `codec`'s encoding of `numel` zeros."""
    view = memoryview(data).cast("B")
    size = view.nbytes
    if size == 0 or size != codec.encoded_nbytes(numel):
        return False
    head, fill = codec.zero_layout(numel)
    step = max(1, size // SAMPLES)
    for index in range(0, size, step):  # a trained tensor's first scale ends this at once
        if view[index] != (0 if index < head else fill):
            return False
    raw = np.frombuffer(view, dtype=np.uint8)
    for start in range(0, size, CHECK_BYTES):
        piece = raw[start:start + CHECK_BYTES]
        split = min(max(head - start, 0), piece.size)  # the scales' part of this piece
        if piece[:split].any() or (piece[split:] != fill).any():
            return False
    return True


def zero_bytes(codec: Codec, numel: int) -> bytes:
    """`codec`'s encoding of `numel` zeros, written from its layout."""
    head, fill = codec.zero_layout(numel)
    return bytes(head) + bytes([fill]) * (codec.encoded_nbytes(numel) - head)


def zero_names(codec: Codec, payload: Mapping[str, bytes | bytearray | memoryview],
               numels: Mapping[str, int]) -> set[str]:
    """The tensors of `payload` whose bytes are the encoding of zeros (`numels`: each one's number of values)."""
    return {name for name, data in payload.items() if encodes_zeros(codec, numels[name], data)}


def with_zeros(codec: Codec, order: Sequence[tuple[str, bool, int, int]], sent: bytes | bytearray | memoryview,
               ) -> Iterable[tuple[str, bytes]]:
    """Each tensor's bytes in header order, from (name, zero, nbytes, numel): those marked zero written here, the
    others cut from `sent`, the bytes that travelled, back to back."""
    offset = 0
    for name, zero, nbytes, numel in order:
        if zero:
            yield name, zero_bytes(codec, numel)
        else:
            yield name, bytes(sent[offset:offset + nbytes])
            offset += nbytes
