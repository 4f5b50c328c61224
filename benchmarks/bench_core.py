"""Core benchmarks (issue: Decoupled DiLoCo core). Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_core.py [--values 25000000] [--learners 8] [--steps 200]

1. RDA merge throughput: `learners` pseudo-gradients of `values` float32 each, merged with RDA on one
   thread; GB/s of input (target >= 1 GB/s).
2. int4 encode and decode throughput on one tensor of `values` float32 (target >= 300 MB/s each).
3. Learner bookkeeping overhead per inner step on the default tiny model: the same inner steps in a
   bare loop and inside a Learner (counters, schedule, pseudo-gradient encoding at due rounds), run
   interleaved in one process so both see the same machine load (target <= 2 %).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig
from ddiloco.data import DataConfig, load_corpus, shard_stream
from ddiloco.learner import Learner
from ddiloco.merge import rda
from ddiloco.messages import FragmentState, Welcome
from ddiloco.model import build_model
from ddiloco.training import InnerConfig, inner_step, make_inner_optimizer

GB = 1e9
MB = 1e6


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_rda(values: int, learners: int) -> None:
    generator = torch.Generator().manual_seed(0)
    deltas = [torch.randn(values, generator=generator) for _ in range(learners)]
    weights = [float(i + 1) for i in range(learners)]
    seconds = best_of(3, lambda: rda(deltas, weights))
    input_bytes = values * learners * 4
    print(f"RDA merge: {learners} x {values:,} fp32 = {input_bytes / GB:.2f} GB in {seconds:.3f} s "
          f"-> {input_bytes / seconds / GB:.2f} GB/s (target >= 1 GB/s)")


def bench_int4(values: int) -> None:
    codec = get_codec("int4")
    tensor = torch.randn(values, generator=torch.Generator().manual_seed(1))
    data = codec.encode(tensor)
    encode_s = best_of(3, lambda: codec.encode(tensor))
    decode_s = best_of(3, lambda: codec.decode(data, (values,)))
    nbytes = values * 4
    print(f"int4 encode: {nbytes / encode_s / MB:.0f} MB/s, decode: {nbytes / decode_s / MB:.0f} MB/s "
          f"(target >= 300 MB/s; {len(data) * 8 / values:.2f} bits/value)")


def _joined_learner(config: DilocoConfig, model, optimizer) -> Learner:
    learner = Learner(config, learner_id=0, model=model, optimizer=optimizer)
    states = tuple(FragmentState(p, 0, {n: dict(model.named_parameters())[n].detach().clone() for n in names})
                   for p, names in enumerate(learner.plan.fragments))
    learner.receive(Welcome(0, states, config.fingerprint()))
    return learner


def bench_learner_overhead(steps: int) -> None:
    config = DilocoConfig()  # defaults: P = 4, H = 32, int4
    data_config = DataConfig()
    corpus = load_corpus()
    torch.manual_seed(0)
    bare_model, wrapped_model = build_model(), build_model()
    inner = InnerConfig()
    bare_opt, wrapped_opt = make_inner_optimizer(bare_model, inner), make_inner_optimizer(wrapped_model, inner)
    learner = _joined_learner(config, wrapped_model, wrapped_opt)
    stream = shard_stream(corpus, data_config, shard=0, num_shards=1)
    batches = [stream.next_batch() for _ in range(32)]
    bare_times, wrapped_times = [], []
    for step in range(steps):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        inner_step(bare_model, bare_opt, batch)
        bare_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        inner_step(wrapped_model, wrapped_opt, batch)
        for update in learner.after_inner_step(batch.tokens):
            # No syncer here: answer each update at once with the learner's own values, so the
            # learner never blocks and the measured cost is the learner's own bookkeeping.
            params = dict(wrapped_model.named_parameters())
            names = learner.plan.fragments[update.fragment]
            learner.receive(FragmentState(update.fragment, learner.versions[update.fragment] + 1,
                                          {n: params[n].detach().clone() for n in names}))
        wrapped_times.append(time.perf_counter() - start)
    warm = steps // 10
    bare = statistics.mean(bare_times[warm:])
    wrapped = statistics.mean(wrapped_times[warm:])
    print(f"learner overhead: bare {bare * 1e3:.2f} ms/step, with Learner {wrapped * 1e3:.2f} ms/step "
          f"-> {100 * (wrapped - bare) / bare:+.2f} % (target <= 2 %; {steps} interleaved steps, "
          f"{config.num_fragments} fragments, H = {config.sync_every}, codec {config.codec})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=25_000_000)
    parser.add_argument("--learners", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    bench_rda(args.values, args.learners)
    bench_int4(args.values)
    bench_learner_overhead(args.steps)


if __name__ == "__main__":
    main()
