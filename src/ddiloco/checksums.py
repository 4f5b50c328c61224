"""zlib's CRC-32 of a long run of bytes on several threads: each piece's CRC (the compiled kernel's, which folds the
bytes with carry-less multiplies, about 2.5x zlib's speed here; zlib's without it; both release the GIL), the
pieces' CRCs joined in order by the arithmetic of CRC concatenation. The result is `zlib.crc32` of the whole run, bit
for bit, whatever the number of pieces.

Joining: a CRC-32 is the message polynomial times x^32, reduced modulo the CRC polynomial P, plus terms from the
initial and final inversions that cancel between two pieces. So with A followed by B (|B| = n bytes),
crc(A B) = crc(A) * x^(8n) mod P, plus crc(B). zlib's CRC is bit-reflected: bit 31 of a 32-bit value holds the
coefficient of x^0 and bit 0 that of x^31, and multiplying by x is a right shift, reduced by the reflected P
(0xEDB88320) when the x^31 coefficient moves out.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np

from ddiloco import kernels
from ddiloco.kernels import INLINE, KernelThreads

REFLECTED_POLY = 0xEDB88320
"""CRC-32's P = x^32 + x^26 + ... + 1 without its x^32 term, bit-reflected (zlib's)."""
ONE = 1 << 31
"""The polynomial 1, reflected."""
MIN_PIECE_BYTES = 1 << 20
"""Pieces smaller than this are not worth a thread."""


def _times(a: int, b: int) -> int:
    """a * b mod P, both reflected."""
    product = 0
    for degree in range(32):  # b holds b * x^degree
        if a >> (31 - degree) & 1:
            product ^= b
        b = (b >> 1) ^ (REFLECTED_POLY if b & 1 else 0)
    return product


@functools.lru_cache(maxsize=256)
def _x_to_the(bits: int) -> int:
    """x^bits mod P, reflected (cached: a syncer joins pieces of the same few sizes round after round)."""
    result, power = ONE, ONE >> 1  # 1 and x
    while bits:
        if bits & 1:
            result = _times(result, power)
        power = _times(power, power)
        bits >>= 1
    return result


def crc32_join(crc_a: int, crc_b: int, length_b: int) -> int:
    """zlib.crc32(A + B) from zlib.crc32(A), zlib.crc32(B) and len(B)."""
    return _times(_x_to_the(8 * length_b), crc_a) ^ crc_b


def _piece_crc32(data: memoryview, crc: int = 0) -> int:
    """zlib.crc32(data, crc)."""
    if kernels.compiled is None or data.nbytes == 0:
        return zlib.crc32(data, crc)
    address = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    return kernels.compiled.crc32(address, data.nbytes, crc)


def crc32(pieces: Sequence[memoryview], threads: KernelThreads = INLINE) -> int:
    """zlib.crc32 of the pieces one after the other (contiguous byte views), each cut further to use `threads`."""
    cuts: list[memoryview] = []
    for piece in pieces:
        parts = max(1, min(threads.count(), piece.nbytes // MIN_PIECE_BYTES))
        step = -(-piece.nbytes // parts) if parts > 1 else max(1, piece.nbytes)
        cuts += [piece[start:start + step] for start in range(0, piece.nbytes, step)] or [piece]
    if len(cuts) == 1 or threads.count() == 1:
        crc = 0
        for cut in cuts:
            crc = _piece_crc32(cut, crc)
        return crc
    per_thread = -(-len(cuts) // threads.count())
    groups = [(first, min(first + per_thread, len(cuts))) for first in range(0, len(cuts), per_thread)]
    crcs = threads.run(lambda first, last: [_piece_crc32(cut) for cut in cuts[first:last]], groups)
    crc = 0
    for cut, piece_crc in zip(cuts, (c for group in crcs for c in group), strict=True):
        crc = crc32_join(crc, piece_crc, cut.nbytes)
    return crc
