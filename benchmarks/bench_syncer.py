"""The syncer at scale (issue 16). Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_syncer.py core [--params 16M,128M] [--learners 8] [--threads 1,2]
    .venv/bin/python benchmarks/bench_syncer.py core --params 1B --fragments 24

`core`: the syncer core's work per round, against the memory-bound floor measured in the same run. A
model of `params` float32 parameters in `fragments` fragments, `learners` learners, int4 uplink, int8
downlink (the defaults). Each round takes one fragment (round robin) through what the running syncer does:
every learner's update checked (`decode_payload`, what the wire layer does outside the service's lock: each update
whole on one of the gRPC server's threads, updates side by side, here shared out over `threads` threads; with the
compiled kernels an int4 update is read from its codes, `ddiloco.kernels`), then each handed to the core
(`Syncer.receive`: added to the round's running sums; the last one closes the round: merge, outer step,
downlink change). The floor is one `add_` pass over the same number of learner-values (`learners` x fragment
size float32 values added into one accumulator), best of the same repeats, measured in the same process after
the rounds of each thread count, at the same torch thread count. Rounds are timed after one warm-up round per
fragment (its first outer step allocates the momentum and touches the residual) and one after each change of the
thread count. Targets: at most 4x the floor per value on one
thread, and at least 1.7x faster on 2 threads than on 1.

The fleet of 128 learners over real gRPC is `bench_fleet.py`; the downlink's fragment throughput is
`bench_runtime.py --only bench_grpc_fragment_throughput`.
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import time

import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.kernel_threads import KernelThreads
from ddiloco.messages import Join, Update
from ddiloco.syncer import Syncer
from ddiloco.update_values import DecodeBuffers, decode_payload, reads_in_place

TENSORS_PER_FRAGMENT = 4
"""Each fragment is this many equal tensors (a layer's weight matrices, roughly)."""
DISTINCT_PAYLOADS = 2
"""Distinct encoded pseudo-gradients per fragment, reused round robin by the learners: encoding 8 x 1 B values
takes minutes, and the syncer's work per update does not depend on which values it decodes."""
STEPS, TOKENS_PER_STEP = 32, 4096
"""Every update: 32 inner steps of 4,096 tokens (equal weights: no cap binds)."""


def parse_count(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "B": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class CoreCase:
    """One syncer core with its learners joined and their payloads encoded."""

    def __init__(self, params: int, fragments: int, learners: int) -> None:
        per_tensor = params // (fragments * TENSORS_PER_FRAGMENT)
        self.config = DilocoConfig(num_fragments=fragments, codec="int4")
        initial = {f"f{p}.t{k}": torch.zeros(per_tensor) for p in range(fragments)
                   for k in range(TENSORS_PER_FRAGMENT)}
        self.syncer = Syncer(self.config, QuorumConfig(min_quorum=learners, grace="none"), initial_params=initial)
        del initial
        gc.collect()
        self.learners = learners
        self.fragment_values = per_tensor * TENSORS_PER_FRAGMENT
        for learner_id in range(learners):
            self.syncer.receive(Join(learner_id, self.syncer.spec, self.config.fingerprint()), 0.0)
        codec = get_codec(self.config.codec)
        generator = torch.Generator().manual_seed(0)
        self.codec = codec
        self.shapes = {t.name: t.shape for t in self.syncer.spec.tensors}
        # The payloads of fragment 0, sent for every fragment (the same shapes): (DISTINCT_PAYLOADS) dicts.
        names = self.syncer.plan.fragments[0]
        self.payloads = [{k: codec.encode(1e-3 * torch.randn(per_tensor, generator=generator))
                          for k in range(TENSORS_PER_FRAGMENT)} for _ in range(DISTINCT_PAYLOADS)]
        assert len(names) == TENSORS_PER_FRAGMENT
        self.next_fragment = 0
        self.now = 1.0
        self.buffers = DecodeBuffers()
        # The wire layer decodes each update whole on one of the gRPC server's threads, updates side by side: here
        # the round's updates are shared out over the process's threads, one after the other on each.
        self.threads = KernelThreads()

    def round(self) -> tuple[float, float, float]:
        """One round of the next fragment: (seconds decoding and checking, seconds in the core, of which the last
        update's: its sum and the close)."""
        p = self.next_fragment
        self.next_fragment = (p + 1) % self.syncer.plan.num_fragments
        names = self.syncer.plan.fragments[p]
        payloads = [{name: self.payloads[learner_id % DISTINCT_PAYLOADS][int(name.rsplit("t", 1)[1])]
                     for name in names} for learner_id in range(self.learners)]
        taken = [([] if reads_in_place(self.codec) else  # as the wire layer: int4 is read from its codes
                  [self.buffers.take(self.codec.buffer_numel(math.prod(self.shapes[n]))) for n in names])
                 for _ in range(self.learners)]
        decoded: list = [None] * self.learners

        def decode(first: int, stop: int) -> None:  # the updates [first, stop), one after the other, on one thread
            for i in range(first, stop):
                decoded[i] = decode_payload(self.codec, payloads[i], names, self.shapes, into=taken[i])

        start = time.perf_counter()
        self.threads.run([(decode, self.threads.split(self.learners, min_split=1))])
        middle = time.perf_counter()
        version = self.syncer.versions[p]
        last = middle
        for learner_id, values in enumerate(decoded):
            assert not isinstance(values, tuple), values
            last = time.perf_counter()
            self.syncer.receive(Update(learner_id, p, version, STEPS * (version + 1), STEPS, STEPS * TOKENS_PER_STEP,
                                       self.config.codec, payloads[learner_id], decoded=values), self.now)
        end = time.perf_counter()
        for buffers in taken:
            self.buffers.give(buffers)  # as the gRPC server does once the core has taken the update
        assert self.syncer.versions[p] == version + 1, "the round did not close"
        self.now += 1.0
        return middle - start, end - middle, end - last

    def floor(self) -> float:
        """One add_ pass over the round's learner-values: `learners` x fragment float32 values into one sum."""
        total = torch.zeros(self.fragment_values)
        values = torch.full((self.fragment_values,), 1e-3)
        start = time.perf_counter()
        for _ in range(self.learners):
            total.add_(values)
        return time.perf_counter() - start


def bench_core(params_list: list[int], fragments: int, learners: int, threads_list: list[int], repeats: int) -> None:
    print(f"syncer core per round: int4 uplink, int8 downlink, {learners} learners, {fragments} fragments, best of "
          f"{repeats} rounds (torch {torch.__version__})")
    print(f"{'params':>8} {'threads':>7} {'values/round':>12} {'round s':>8} {'decode s':>8} {'core s':>7} "
          f"{'close s':>7} {'floor s':>8} {'x floor':>7} {'Mvalues/s':>9}   (the best round's; close: the last "
          "update's sum and the close)")
    for params in params_list:
        case = CoreCase(params, fragments, learners)
        for _ in range(fragments):  # warm: every fragment's momentum and residual pages are touched once
            case.round()
        best: dict[int, float] = {}
        for threads in threads_list:
            torch.set_num_threads(threads)
            # The rounds first, then the floors: torch's OpenMP workers spin for a few ms after a parallel add_, on
            # the cores the next round's kernel threads need. One round untimed after the thread count changed.
            case.round()
            rounds = []
            for _ in range(repeats):
                decode_s, core_s, close_s = case.round()
                rounds.append((decode_s + core_s, decode_s, core_s, close_s))
            floors = [case.floor() for _ in range(repeats)]
            total, decode_s, core_s, close_s = min(rounds)
            floor = min(floors)
            values = learners * case.fragment_values
            best[threads] = total
            print(f"{params / 1e6:>7.0f}M {threads:>7} {values:>12,} {total:>8.3f} {decode_s:>8.3f} {core_s:>7.3f} "
                  f"{close_s:>7.3f} {floor:>8.3f} {total / floor:>7.2f} {values / total / 1e6:>9.0f}")
        if len(best) > 1:
            one = best[min(best)]
            for threads, seconds in sorted(best.items())[1:]:
                print(f"{'':>8} {threads} threads: {one / seconds:.2f}x faster than {min(best)} (target >= 1.7x at 2)")
        print(f"{'':>8} peak RSS so far {rss_gib():.1f} GiB")
        del case
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    core = sub.add_parser("core", help="per-round work of the syncer core against the add_ floor")
    core.add_argument("--params", default="16M,128M", help="comma-separated model sizes (K, M, B suffixes)")
    core.add_argument("--fragments", type=int, default=4)
    core.add_argument("--learners", type=int, default=8)
    core.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    core.add_argument("--repeats", type=int, default=5, help="rounds per thread count (best is shown)")
    args = parser.parse_args()
    if args.command == "core":
        bench_core([parse_count(p) for p in args.params.split(",")], args.fragments, args.learners,
                   [int(t) for t in args.threads.split(",")], args.repeats)


if __name__ == "__main__":
    main()
