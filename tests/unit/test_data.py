"""Data: corpus integrity, disjoint shards, deterministic and resumable streams, fixed validation."""

import gzip
import hashlib
import json

import pytest
import torch

from ddiloco.data import (
    CORPUS_NUM_BYTES,
    CORPUS_SHA256,
    Batch,
    CorpusDamagedError,
    DataConfig,
    _shard_seed,
    decode_corpus,
    held_out_start,
    load_corpus,
    shard_byte_range,
    shard_byte_ranges,
    shard_stream,
    validation_batches,
)


def _random_corpus(num_bytes: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (num_bytes,), generator=generator, dtype=torch.uint8).tolist())


def _assert_batches_equal(first: Batch, second: Batch) -> None:
    assert torch.equal(first.inputs, second.inputs)
    assert torch.equal(first.targets, second.targets)
    assert first.tokens == second.tokens


def _windows(batch: Batch) -> list[bytes]:
    """Each sequence's full window: its inputs plus the last target byte."""
    window_BW = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
    return [bytes(row.tolist()) for row in window_BW]


# --- corpus ---------------------------------------------------------------------------------------


def test_corpus_has_recorded_length_and_checksum():
    corpus = load_corpus()
    assert len(corpus) == CORPUS_NUM_BYTES
    assert hashlib.sha256(corpus).hexdigest() == CORPUS_SHA256
    assert corpus.startswith(b"ALL'S WELL THAT ENDS WELL")  # alls_well_that_ends_well_gut.txt sorts first
    assert max(corpus) < 128  # plain ASCII
    assert b"\r" not in corpus


def test_damaged_corpus_checksum_is_reported():
    text = b"To be, or not to be,--that is the question:\n"
    compressed = gzip.compress(text, mtime=0)
    assert decode_corpus(compressed, expected_sha256=hashlib.sha256(text).hexdigest()) == text
    altered = gzip.compress(text.replace(b"be,", b"bee"), mtime=0)
    with pytest.raises(CorpusDamagedError, match="is damaged: SHA-256"):
        decode_corpus(altered, expected_sha256=hashlib.sha256(text).hexdigest())


def test_truncated_corpus_is_reported():
    compressed = gzip.compress(b"Now is the winter of our discontent\n" * 100, mtime=0)
    with pytest.raises(CorpusDamagedError, match="does not decompress"):
        decode_corpus(compressed[: len(compressed) // 2])


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 is invalid: expected an integer >= 1"),
        ({"context_len": 0}, "context_len=0 is invalid: expected an integer >= 1"),
        ({"context_len": 8.0}, "context_len=8.0 is invalid: expected an integer >= 1"),
        ({"seed": -1}, "seed=-1 is invalid: expected an integer >= 0"),
        ({"val_fraction": 0.0}, "val_fraction must be a number in (0, 1), got 0.0"),
        ({"val_fraction": 1}, "val_fraction must be a number in (0, 1), got 1"),
        ({"shard_layout": "random"},
         "shard_layout='random' is invalid: expected one of contiguous, interleaved, whole"),
        ({"context_len": 8, "shard_block_bytes": 8}, "shard_block_bytes=8 is invalid: expected an integer >= 9"),
    ],
)
def test_config_validation_names_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        DataConfig(**kwargs)
    assert str(excinfo.value) == message


# --- shards ---------------------------------------------------------------------------------------


def test_shard_ranges_are_disjoint_equal_and_inside_the_training_part():
    config = DataConfig(context_len=8, val_fraction=0.1, shard_layout="contiguous")
    num_bytes = 1_003
    train_bytes = held_out_start(num_bytes, config.val_fraction)
    assert train_bytes == 903
    ranges = [shard_byte_range(num_bytes, config, shard=i, num_shards=4) for i in range(4)]
    assert ranges == [(0, 225), (225, 450), (450, 675), (675, 900)]
    corpus = _random_corpus(num_bytes, seed=0)
    streams = [shard_stream(corpus, config, shard=i, num_shards=4) for i in range(4)]
    assert [stream.byte_range for stream in streams] == ranges


def test_windows_stay_inside_their_own_shard():
    # Shard i of this corpus holds only byte value i + 1 (the held-out tail holds 0), so any window
    # that strayed across a boundary would show a foreign value.
    config = DataConfig(batch_size=64, context_len=16, val_fraction=0.2, shard_layout="contiguous")
    num_shards, shard_bytes = 3, 40
    corpus = b"".join(bytes([i + 1]) * shard_bytes for i in range(num_shards)) + bytes(30)
    for i in range(num_shards):
        stream = shard_stream(corpus, config, shard=i, num_shards=num_shards)
        assert stream.byte_range == (i * shard_bytes, (i + 1) * shard_bytes)
        for _ in range(5):
            batch = stream.next_batch()
            assert set(batch.inputs.unique().tolist()) == {i + 1}
            assert set(batch.targets.unique().tolist()) == {i + 1}


def test_windows_are_contiguous_text_from_the_shard():
    corpus = load_corpus()
    config = DataConfig(batch_size=8, context_len=64, shard_layout="contiguous")
    stream = shard_stream(corpus, config, shard=2, num_shards=4)
    start, stop = stream.byte_range
    shard_text = corpus[start:stop]
    for _ in range(3):
        for window in _windows(stream.next_batch()):
            assert window in shard_text


def test_every_start_in_a_shard_is_reachable():
    # A shard of 12 bytes with context 8 has exactly 12 - 8 = 4 valid window starts, including the
    # last one whose final target is the shard's last byte.
    config = DataConfig(batch_size=256, context_len=8, val_fraction=0.5, shard_layout="contiguous")
    corpus = bytes(range(24)) + bytes(24)
    stream = shard_stream(corpus, config, shard=0, num_shards=2)
    assert stream.byte_range == (0, 12)
    first_bytes = set(stream.next_batch().inputs[:, 0].tolist())
    assert first_bytes == {0, 1, 2, 3}


def test_small_corpus_error_says_what_each_shard_has_and_needs():
    config = DataConfig(context_len=128, val_fraction=0.05, shard_layout="contiguous")
    corpus = bytes(1_000)
    with pytest.raises(ValueError) as excinfo:
        shard_stream(corpus, config, shard=0, num_shards=8)
    message = str(excinfo.value)
    assert "corpus too small" in message
    assert "8 shards 118 bytes" in message  # 950 training bytes // 8
    assert "needs at least context_len + 1 = 129 bytes" in message


@pytest.mark.parametrize(
    ("shard", "num_shards", "message"),
    [
        (2, 2, "shard must be in [0, num_shards=2), got 2"),
        (-1, 2, "shard=-1 is invalid: expected an integer >= 0"),
        (0, 0, "num_shards=0 is invalid: expected an integer >= 1"),
    ],
)
def test_bad_shard_arguments_are_rejected(shard, num_shards, message):
    with pytest.raises(ValueError) as excinfo:
        shard_stream(bytes(10_000), DataConfig(), shard=shard, num_shards=num_shards)
    assert str(excinfo.value) == message


def test_interleaved_blocks_are_dealt_round_robin_and_windows_never_cross_one():
    # Block b of 20 bytes holds only byte value b + 1: a window across two blocks would show two values. 130 training
    # bytes make 6 whole blocks (the last 10 bytes belong to no shard); the tail holds 0.
    config = DataConfig(batch_size=64, context_len=8, val_fraction=0.2, shard_layout="interleaved",
                        shard_block_bytes=20)
    corpus = b"".join(bytes([b + 1]) * 20 for b in range(6)) + bytes([99]) * 10 + bytes(32)
    assert held_out_start(len(corpus), config.val_fraction) == 130
    expected = {0: [(0, 20), (60, 80)], 1: [(20, 40), (80, 100)], 2: [(40, 60), (100, 120)]}
    for shard, ranges in expected.items():
        assert shard_byte_ranges(len(corpus), config, shard=shard, num_shards=3) == ranges
        stream = shard_stream(corpus, config, shard=shard, num_shards=3)
        assert stream.byte_ranges == ranges
        assert stream.byte_range == (ranges[0][0], ranges[-1][1])
        seen = set()
        for window in _windows(stream.next_batch()):
            assert len(set(window)) == 1  # inside one block
            seen |= set(window)
        assert seen == {a // 20 + 1 for a, _ in ranges}  # 64 draws reach both of its blocks


def test_every_start_of_every_interleaved_block_is_reachable():
    # Blocks of 12 bytes with context 8 hold 12 - 8 = 4 window starts each; shard 0 of 2 owns blocks 0 and 2.
    config = DataConfig(batch_size=256, context_len=8, val_fraction=0.5, shard_layout="interleaved",
                        shard_block_bytes=12)
    corpus = bytes(range(48)) + bytes(48)
    stream = shard_stream(corpus, config, shard=0, num_shards=2)
    assert stream.byte_ranges == [(0, 12), (24, 36)]
    assert set(stream.next_batch().inputs[:, 0].tolist()) == {0, 1, 2, 3, 24, 25, 26, 27}


def test_the_contiguous_layout_draws_the_windows_it_drew_before_the_layouts():
    # Before the layouts, a window started at the generator's draw itself: randint(0, shard bytes - context).
    corpus = _random_corpus(20_000, seed=6)
    config = DataConfig(batch_size=5, context_len=16, seed=3, shard_layout="contiguous")
    stream = shard_stream(corpus, config, shard=1, num_shards=2)
    start, stop = shard_byte_range(len(corpus), config, shard=1, num_shards=2)
    generator = torch.Generator().manual_seed(_shard_seed(3, 1))
    for _ in range(3):
        starts = torch.randint(0, (stop - start) - 16, (5,), generator=generator)
        assert _windows(stream.next_batch()) == [corpus[start + s : start + s + 17] for s in starts.tolist()]


def test_the_whole_layout_gives_every_shard_the_training_part_and_its_own_draws():
    config = DataConfig(batch_size=256, context_len=8, val_fraction=0.5, shard_layout="whole")
    corpus = bytes(range(24)) + bytes(24)
    streams = [shard_stream(corpus, config, shard=i, num_shards=2) for i in range(2)]
    assert [stream.byte_ranges for stream in streams] == [[(0, 24)], [(0, 24)]]
    first = [stream.next_batch().inputs[:, 0] for stream in streams]
    assert set(first[0].tolist()) == set(first[1].tolist()) == set(range(24 - 8))  # every start, none in the tail
    assert not torch.equal(first[0], first[1])  # each shard its own generator


def test_interleaved_layout_needs_a_block_per_shard():
    config = DataConfig(context_len=8, val_fraction=0.5, shard_layout="interleaved", shard_block_bytes=20)
    with pytest.raises(ValueError, match="holds 2 blocks of shard_block_bytes=20, fewer than the 3 shards"):
        shard_stream(bytes(80), config, shard=0, num_shards=3)


# --- streams --------------------------------------------------------------------------------------


def test_same_seed_and_shard_give_the_same_batches():
    corpus = _random_corpus(20_000, seed=1)
    config = DataConfig(batch_size=4, context_len=16, seed=3)
    first = shard_stream(corpus, config, shard=1, num_shards=2)
    second = shard_stream(corpus, config, shard=1, num_shards=2)
    for _ in range(4):
        _assert_batches_equal(first.next_batch(), second.next_batch())


def test_different_seed_or_shard_gives_different_batches():
    # Both shards of this corpus hold bytes 0..199, so a window's first input byte is its start
    # offset within the shard: different shards must draw different offsets, not just other text.
    config = DataConfig(batch_size=8, context_len=16, val_fraction=0.2, seed=3)
    corpus = bytes(range(200)) * 2 + bytes(100)
    offsets = [
        shard_stream(corpus, config, shard=i, num_shards=2).next_batch().inputs[:, 0] for i in range(2)
    ]
    assert not torch.equal(offsets[0], offsets[1])
    other_seed = DataConfig(batch_size=8, context_len=16, val_fraction=0.2, seed=4)
    assert not torch.equal(
        offsets[0], shard_stream(corpus, other_seed, shard=0, num_shards=2).next_batch().inputs[:, 0]
    )


def test_batch_shapes_dtypes_and_token_count():
    corpus = _random_corpus(20_000, seed=2)
    stream = shard_stream(corpus, DataConfig(batch_size=5, context_len=12), shard=0, num_shards=1)
    batch = stream.next_batch()
    assert batch.inputs.shape == batch.targets.shape == (5, 12)
    assert batch.inputs.dtype == batch.targets.dtype == torch.int64
    assert batch.tokens == 60
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])  # targets are inputs shifted by one
    partial = stream.next_batch(batch_size=2)
    assert partial.inputs.shape == (2, 12)
    assert partial.tokens == 24
    assert stream.batches_drawn == 2
    with pytest.raises(ValueError, match="batch_size=0 is invalid: expected an integer >= 1"):
        stream.next_batch(batch_size=0)


def test_restored_cursor_continues_with_the_same_batches():
    corpus = _random_corpus(50_000, seed=3)
    config = DataConfig(batch_size=4, context_len=32, seed=9)
    uninterrupted = shard_stream(corpus, config, shard=1, num_shards=3)
    for size in (4, 2, 4):
        uninterrupted.next_batch(batch_size=size)
    saved = json.loads(json.dumps(uninterrupted.state_dict()))
    assert saved["batches_drawn"] == 3

    restored = shard_stream(corpus, config, shard=1, num_shards=3)
    restored.load_state_dict(saved)
    assert restored.batches_drawn == 3
    for size in (4, 1, 4):
        _assert_batches_equal(uninterrupted.next_batch(batch_size=size), restored.next_batch(batch_size=size))
    assert restored.state_dict() == uninterrupted.state_dict()


def test_cursor_from_another_shard_is_rejected():
    corpus = _random_corpus(20_000, seed=4)
    config = DataConfig(batch_size=2, context_len=8)
    saved = shard_stream(corpus, config, shard=0, num_shards=2).state_dict()
    other = shard_stream(corpus, config, shard=1, num_shards=2)
    with pytest.raises(ValueError, match="shard is 0, expected 1"):
        other.load_state_dict(saved)


def test_an_interleaved_cursor_restores_and_a_cursor_of_the_other_layout_is_rejected():
    corpus = _random_corpus(50_000, seed=7)
    interleaved = DataConfig(batch_size=4, context_len=32, shard_layout="interleaved", shard_block_bytes=1_000)
    uninterrupted = shard_stream(corpus, interleaved, shard=1, num_shards=3)
    uninterrupted.next_batch()
    restored = shard_stream(corpus, interleaved, shard=1, num_shards=3)
    restored.load_state_dict(json.loads(json.dumps(uninterrupted.state_dict())))
    _assert_batches_equal(uninterrupted.next_batch(), restored.next_batch())

    contiguous = shard_stream(corpus, DataConfig(batch_size=4, context_len=32, shard_layout="contiguous"), shard=1,
                              num_shards=3)
    with pytest.raises(ValueError, match="shard_layout is 'contiguous', expected 'interleaved'"):
        restored.load_state_dict(contiguous.state_dict())
    other_blocks = shard_stream(corpus, DataConfig(batch_size=4, context_len=32, shard_layout="interleaved",
                                                   shard_block_bytes=2_000), shard=1, num_shards=3)
    with pytest.raises(ValueError, match="shard_block_bytes is 1000, expected 2000"):
        other_blocks.load_state_dict(uninterrupted.state_dict())
    # A cursor saved before the layouts existed (no shard_layout key) is a contiguous one.
    old = contiguous.state_dict()
    del old["shard_layout"], old["shard_block_bytes"]
    contiguous.load_state_dict(old)
    with pytest.raises(ValueError, match="shard_layout is 'contiguous', expected 'interleaved'"):
        restored.load_state_dict(old)


# --- validation -----------------------------------------------------------------------------------


def test_validation_batches_are_fixed_and_read_the_tail_in_order():
    corpus = _random_corpus(10_000, seed=5)
    config = DataConfig(batch_size=3, context_len=10, val_fraction=0.1)
    first = validation_batches(corpus, config, num_batches=4)
    second = validation_batches(corpus, config, num_batches=4)
    assert len(first) == 4
    for a, b in zip(first, second, strict=True):
        _assert_batches_equal(a, b)
    tail = corpus[held_out_start(len(corpus), config.val_fraction) :]
    inputs = torch.cat([batch.inputs for batch in first]).flatten()
    targets = torch.cat([batch.targets for batch in first]).flatten()
    assert bytes(inputs.tolist()) == tail[:120]
    assert bytes(targets.tolist()) == tail[1:121]
    assert all(batch.tokens == 30 for batch in first)


def test_validation_is_disjoint_from_training():
    # Training bytes are 1, held-out bytes 2: validation must see only 2s, every shard only 1s.
    config = DataConfig(batch_size=4, context_len=8, val_fraction=0.25)
    corpus = bytes([1]) * 300 + bytes([2]) * 100
    assert held_out_start(len(corpus), config.val_fraction) == 300
    for batch in validation_batches(corpus, config, num_batches=3):
        assert set(torch.cat([batch.inputs, batch.targets]).unique().tolist()) == {2}
    for i in range(3):
        stream = shard_stream(corpus, config, shard=i, num_shards=3)
        assert stream.byte_range[1] <= 300
        assert set(stream.next_batch().targets.unique().tolist()) == {1}


def test_validation_error_says_what_the_tail_has_and_needs():
    config = DataConfig(batch_size=4, context_len=8, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"held-out tail too small: 100 bytes .* need 129;"):
        validation_batches(bytes(1_000), config, num_batches=4)
    assert len(validation_batches(bytes(1_000), config, num_batches=3)) == 3  # 3 * 4 * 8 + 1 = 97 fits


def test_default_validation_fits_the_corpus():
    batches = validation_batches(load_corpus(), DataConfig(), num_batches=2)
    assert [batch.inputs.shape for batch in batches] == [(16, 128), (16, 128)]
