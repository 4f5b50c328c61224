"""What checksumming the run's files costs: CRC-32 of a tensors file, against writing it durably.

Every round's tensors file, full state and genesis records a CRC-32 of its bytes (`ddiloco.checkpoint.
bytes_checksum`) and checks it on every read. For a 4 MB and a 100 MB file of float32 tensors this prints
the time to checksum the bytes; the durable write without a checksum (serialise, write, fsync: what
`save_tensors` did before) and with it (`save_tensors` now, which checksums while the bytes go to disk);
the whole round commit (`RoundLog.append`: the tensors, then the line, each fsynced); and a verified read.

    .venv/bin/python benchmarks/bench_checksums.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from ddiloco.checkpoint import CHECKSUM_KEY, atomic_write_bytes, bytes_checksum, load_tensors, save_tensors
from ddiloco.messages import RoundRecord
from ddiloco.round_log import RoundLog

SIZES_MB = (4, 100)
FLOAT32_BYTES = 4
TENSORS_PER_FILE = 8
"""A round's merged pseudo-gradient is a fragment's parameters: a handful of tensors."""


def _tensors(size_mb: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    numel = size_mb * 2**20 // FLOAT32_BYTES // TENSORS_PER_FILE
    return {f"layer{i}.weight": torch.randn(numel, generator=generator) for i in range(TENSORS_PER_FILE)}


def _best_s(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _record(index: int, tensors: dict[str, torch.Tensor]) -> RoundRecord:
    return RoundRecord(round_index=index, fragment=0, version=index + 1, participants=(), merged=tensors,
                       opened_at=0.0, quorum_at=0.0, closed_at=0.0, grace_s=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each measurement; the best is printed")
    args = parser.parse_args()
    print(f"{'file':>6} {'crc32':>8} {'GB/s':>5} {'write, no crc':>14} {'save_tensors':>13} {'added':>7} "
          f"{'round commit':>13} {'verified read':>14}")
    for size_mb in SIZES_MB:
        tensors = _tensors(size_mb, seed=size_mb)
        data = save_safetensors(tensors)
        crc_s = _best_s(args.repeats, lambda data=data: bytes_checksum(data))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tensors.safetensors"
            plain_s = _best_s(args.repeats, lambda t=tensors, p=path: atomic_write_bytes(p, save_safetensors(
                {n: v.contiguous().clone() for n, v in t.items()})))
            save_s = _best_s(args.repeats, lambda t=tensors, p=path: save_tensors(p, t))
            log, indices = RoundLog(tmp), iter(range(10**6))
            commit_s = _best_s(args.repeats, lambda t=tensors, log=log, i=indices: log.append(_record(next(i), t)))
            line = log.lines()[0]
            read_s = _best_s(args.repeats, lambda log=log, line=line: load_tensors(log.tensors_path(0),
                                                                                 checksum=line[CHECKSUM_KEY]))
        print(f"{size_mb:>4}MB {crc_s * 1e3:>6.1f}ms {len(data) / crc_s / 1e9:>5.2f} {plain_s * 1e3:>12.1f}ms "
              f"{save_s * 1e3:>11.1f}ms {(save_s - plain_s) * 1e3:>+5.0f}ms {commit_s * 1e3:>11.1f}ms "
              f"{read_s * 1e3:>12.1f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
