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
from ddiloco.kernel_threads import INLINE, KernelThreads

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
    """zlib.crc32 of the pieces one after the other (contiguous byte views), each cut into one range per thread, all
    handed to the threads at once."""
    tasks = []
    for piece in pieces:
        tasks.append((lambda start, stop, piece=piece: (_piece_crc32(piece[start:stop]), stop - start),
                      threads.split(piece.nbytes, min_split=MIN_PIECE_BYTES)))
    crc = 0
    for parts in threads.run(tasks):
        for part_crc, length in parts:
            crc = crc32_join(crc, part_crc, length)
    return crc
