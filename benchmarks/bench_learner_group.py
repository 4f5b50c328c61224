"""What a learner of several ranks pays per fragment: rank 0's read (a publish) and a write (a fragment from the
syncer) through `LearnerGroup`, with DDP replicas and with FSDP2 shards, side by side in one run.

Starts itself as 2 ranks (gloo, CPU) with `ddiloco.runtime.rank_group`; each rank builds the same TinyGPT,
wraps it (DDP, then FSDP2 per block), and rank 0 reads and writes every fragment `--repeats` times. Printed
per mode: the median time of one fragment's read and write on rank 0, and the bytes each rank receives for
it (DDP: a write broadcasts the full fragment; FSDP2: a read all-gathers it, a write scatters the shards).

    .venv/bin/python benchmarks/bench_learner_group.py [--width 512 --layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from ddiloco.config import DilocoConfig
    from ddiloco.fragments import FragmentPlan
    from ddiloco.learner_group import LearnerGroup
    from ddiloco.model import ModelConfig, build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    config = ModelConfig(width=args.width, num_layers=args.layers, num_heads=8)
    results = []
    for mode in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = build_model(config)
        if mode == "fsdp":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            DistributedDataParallel(model)
        group = LearnerGroup(model, group=None)
        plan = FragmentPlan.for_tensors(dict(model.named_parameters()), DilocoConfig(num_fragments=8))
        group.fragments = plan.fragments
        if rank != 0:
            group.serve()
            continue
        reads, writes = [], []
        for _ in range(args.repeats):
            for p, names in enumerate(plan.fragments):
                started = time.perf_counter()
                values = group.read(p, names)
                reads.append(time.perf_counter() - started)
                started = time.perf_counter()
                group.write(p, values)
                writes.append(time.perf_counter() - started)
        fragment_bytes = sum(v.numel() * 4 for v in values.values())
        group.end(0, done=True)
        results.append((mode, statistics.median(reads), statistics.median(writes), fragment_bytes))
    if rank == 0:
        total = sum(p.numel() for p in build_model(config).parameters())
        print(f"TinyGPT {total:,} parameters, 8 fragments, {size} ranks (gloo, 1 thread each); medians per fragment")
        for mode, read_s, write_s, nbytes in results:
            got_read = nbytes * (size - 1) // size if mode == "fsdp" else 0
            got_write = nbytes // size if mode == "fsdp" else nbytes
            print(f"{mode:>5}: read (publish) {read_s * 1e3:7.1f} ms, each rank receives {got_read / 1e6:5.2f} MB; "
                  f"write (from the syncer) {write_s * 1e3:7.1f} ms, each follower receives {got_write / 1e6:5.2f} MB")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = [sys.executable, __file__, "--worker", "--width", str(args.width), "--layers", str(args.layers),
               "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.call([sys.executable, "-m", "ddiloco.runtime.rank_group", "--nproc", "2", "--", *command],
                             env=env))


if __name__ == "__main__":
    main()
