"""Codec benchmark. Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_compression.py [--values 25000000] [--repeats 3]

For every codec (and int4/int2 at block size 32 too): encode and decode throughput in MB/s of float32
input on one Gaussian tensor of `values` values with one torch thread (best of `repeats`), bits per value
on the wire, and the relative L2 error of the round trip. Target: int4 encode and decode >= 300 MB/s each.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddiloco.compression import CODEC_NAMES, get_codec

MB = 1e6
INT4_TARGET_MB_S = 300.0
VARIANTS = [(name, {}) for name in CODEC_NAMES] + [("int4", {"block_size": 32}), ("int2", {"block_size": 32})]


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    tensor = torch.randn(args.values, generator=torch.Generator().manual_seed(0))
    input_mb = tensor.numel() * 4 / MB
    print(f"{args.values:,} float32 values ({input_mb:.0f} MB), 1 thread, best of {args.repeats}")
    print(f"{'codec':<14}{'encode MB/s':>12}{'decode MB/s':>12}{'bits/value':>12}{'rel. error':>12}")
    for name, options in VARIANTS:
        codec = get_codec(name, **options)
        data = codec.encode(tensor)
        decoded = codec.decode(data, tensor.shape)
        error = float((decoded - tensor).norm() / tensor.norm())
        del decoded
        encode_s = best_of(args.repeats, lambda codec=codec: codec.encode(tensor))
        decode_s = best_of(args.repeats, lambda codec=codec, data=data: codec.decode(data, tensor.shape))
        label = name + "".join(f" B={value}" for value in options.values())
        print(f"{label:<14}{input_mb / encode_s:>12.0f}{input_mb / decode_s:>12.0f}"
              f"{len(data) * 8 / tensor.numel():>12.3f}{error:>12.4f}")
    print(f"target: int4 encode and decode >= {INT4_TARGET_MB_S:.0f} MB/s each")


if __name__ == "__main__":
    main()
