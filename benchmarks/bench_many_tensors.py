"""What a learner's own work costs for a model of very many small tensors (a mixture of experts has tens of
thousands), against the training step it rides on.

A model of `--tensors` small tensors (Linear(8, 8) layers: a weight and a bias each) trains under `ddiloco.session`
with an in-process hub (P = 4, H = 8: a fragment falls due every other step) and a run directory. One run prints,
side by side:

- **plain step**: forward, backward and AdamW of the bare model, no session;
- **session step**: the same with `sync.step()`, averaged over a period (publishes and received fragments included:
  the in-process hub merges and sends back on the training thread, so this is an upper bound on a gRPC learner's);
- **checkpoint**: the training thread's part of a periodic checkpoint (`save(wait=False)`: the snapshot and its
  split; the write is a background thread's), and the deep copy of the same state that the snapshot was before
  2026-12-06, timed on the same state.

    .venv/bin/python benchmarks/bench_many_tensors.py [--tensors 10000] [--steps 16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from torch import nn

import ddiloco
from ddiloco.config import DilocoConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=16, help="measured steps of each kind")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(args.tensors // 2)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(4, 8)

    def train_step() -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()

    plain = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        plain.append(time.perf_counter() - start)
    hub = ddiloco.InProcessHub(config=DilocoConfig(num_fragments=4, sync_every=8))
    with tempfile.TemporaryDirectory() as run_dir, \
            ddiloco.session(model, optimizer, hub=hub, learner_id=0, run_dir=run_dir, inner_steps=10**9,
                            checkpoint_every_s=10**9) as sync:
        stepped = []
        for _ in range(args.steps):
            start = time.perf_counter()
            train_step()
            sync.step(tokens=4)
            stepped.append(time.perf_counter() - start)
        checkpoint = sync._checkpoint
        saves, copies = [], []
        for _ in range(3):
            start = time.perf_counter()
            checkpoint.save(wait=False)
            saves.append(time.perf_counter() - start)
            checkpoint._saver.join()
            state = {"learner": sync.learner.state_dict(), "state": checkpoint._user_state()}
            start = time.perf_counter()
            copy.deepcopy(state)
            copies.append(time.perf_counter() - start)
        sync.request_stop()
    print(f"{args.tensors:,} tensors ({sum(p.numel() for p in model.parameters()):,} parameters), median of "
          f"{args.steps} steps / 3 checkpoints:")
    print(f"  plain step {statistics.median(plain) * 1e3:.0f} ms, session step {statistics.median(stepped) * 1e3:.0f} "
          f"ms (mean {statistics.mean(stepped) * 1e3:.0f} ms)")
    print(f"  checkpoint on the training thread {statistics.median(saves) * 1e3:.0f} ms; a deep copy of its state "
          f"(the snapshot before 2026-12-06) {statistics.median(copies) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
