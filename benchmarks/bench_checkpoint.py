"""What a learner's checkpoint costs, part by part, at the sizes of `bench_learner.py` (TinyGPT 0.5 M, 13 M, 57 M).

One learner joined with P = 8 fragments, one AdamW step taken (so its optimizer holds its moments), then, alternating,
`repeats` times each (a machine whose load changes hurts both alike):

- **learner state**: what `LearnerCheckpoint.save` writes in its background thread, the learner's progress and
  inner-optimizer state (`save_split_state`: two moments per parameter), after the training thread's copy of it;
- **global copy**: `learners/N/global.safetensors` (`ddiloco.global_copy`), the global fragments the learner holds,
  written after it in the same thread: the training thread only takes references (`snapshot`, timed apart).

Both are written durably (fsync) into a temporary directory under /tmp.

    .venv/bin/python benchmarks/bench_checkpoint.py [--sizes 0.5M,13M,57M] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_learner import BATCH, CONTEXT, SIZES, joined_learner

from ddiloco.checkpoint import save_split_state
from ddiloco.global_copy import GLOBAL_COPY_FILE, snapshot, write
from ddiloco.model import build_model, count_parameters
from ddiloco.state_tree import split_state


def measure(size: str, repeats: int) -> None:
    config = SIZES[size]
    torch.manual_seed(0)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = joined_learner(model, optimizer, deferred=False)
    batch = torch.randint(0, config.vocab_size, (BATCH, CONTEXT))
    model(batch, batch)[1].backward()
    optimizer.step()
    state_s, copy_s, snapshot_s = [], [], []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        directory = Path(tmp)
        for serial in range(repeats):
            tensors, tree = split_state({"learner": learner.state_dict()})
            split = ({path: tensor.detach().clone() for path, tensor in tensors.items()}, tree)
            started = time.perf_counter()
            save_split_state(directory / "checkpoint", split, serial=serial, meta={})
            state_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            copy = snapshot(learner)
            snapshot_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            write(directory, copy)
            copy_s.append(time.perf_counter() - started)
        state_bytes = max(f.stat().st_size for f in (directory / "checkpoint").glob("*.safetensors"))
        copy_bytes = (directory / GLOBAL_COPY_FILE).stat().st_size
    state, global_copy = statistics.median(state_s), statistics.median(copy_s)
    print(f"{size:>5} ({count_parameters(model) / 1e6:.1f} M parameters): learner state {state:.3f} s "
          f"({state_bytes / 1e6:.0f} MB), global copy {global_copy:.3f} s ({copy_bytes / 1e6:.0f} MB, "
          f"{global_copy / state:.2f} of the state's time); the training thread's snapshot "
          f"{statistics.median(snapshot_s) * 1e6:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5M,13M,57M")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for size in args.sizes.split(","):
        measure(size, args.repeats)


if __name__ == "__main__":
    main()
