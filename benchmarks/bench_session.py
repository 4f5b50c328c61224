"""Inner steps per second of a learner under `ddiloco.session` against the same bare PyTorch loop.

Side by side in one process and one run, interleaved (bare, session, bare, session, ...) so that a
machine whose load changes hurts both alike. The session is the real runtime: a `ddiloco syncer` process on
127.0.0.1 (its merge work on its own core, as a syncer on another host), one learner (K = 1), P = 4, H = 32,
int4 uplink: every 8 inner steps one fragment is published (the training thread copies it; its pseudo-gradient
and encoding run on the session's publisher thread) and every merged fragment is applied between two steps.
The bare loop is the identical forward/backward/AdamW on the identical batches. Target (issue "Your model, your
data, your loop"): ratio >= 0.98.

    .venv/bin/python benchmarks/bench_session.py [--steps 400] [--repeats 3] [--model tinygpt|gpt2|both]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ddiloco
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.data import DataConfig, load_corpus, shard_stream
from ddiloco.run_config import RunConfig

SYNCER_START_S = 60.0


def tinygpt():
    from ddiloco.model import build_model

    def loss_of(model, batch):
        return model(batch.inputs, batch.targets)[1]

    return build_model, loss_of


def gpt2():
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_gpt2", Path(__file__).parents[1] / "examples" / "gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def loss_of(model, batch):
        logits = model(input_ids=batch.inputs).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))

    return module.build_model, loss_of


def wait_for_address(path: Path, syncer: subprocess.Popen) -> str:
    deadline = time.monotonic() + SYNCER_START_S
    while time.monotonic() < deadline:
        if syncer.poll() is not None:
            raise RuntimeError(f"the syncer exited with {syncer.returncode}")
        try:
            return json.loads(path.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.05)
    raise RuntimeError(f"no {path} after {SYNCER_START_S} s")


def timed_steps(model, optimizer, loss_of, batches, sync=None) -> float:
    started = time.perf_counter()
    for batch in batches:
        loss = loss_of(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if sync is not None:
            sync.step(tokens=batch.tokens)
    return len(batches) / (time.perf_counter() - started)


def bench(name: str, steps: int, repeats: int) -> tuple[float, float]:
    build, loss_of = {"tinygpt": tinygpt, "gpt2": gpt2}[name]()
    context = 64 if name == "gpt2" else 128
    data_config = DataConfig(batch_size=8, context_len=context)
    stream = shard_stream(load_corpus(), data_config, shard=0, num_shards=1)
    batches = [stream.next_batch() for _ in range(steps)]
    config = DilocoConfig(num_fragments=4, sync_every=32)
    torch.manual_seed(0)
    bare_model, session_model = build(), build()
    session_model.load_state_dict(bare_model.state_dict())
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
    session_opt = torch.optim.AdamW(session_model.parameters(), lr=1e-3)
    timed_steps(bare_model, bare_opt, loss_of, batches[:10])  # warm-up: allocator, lazy imports
    run_config = RunConfig(diloco=config, quorum=QuorumConfig(), num_learners=1, inner_steps=2**62)
    with tempfile.TemporaryDirectory() as tmp:
        run_config.save(Path(tmp) / "config.json")
        syncer = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "syncer", "--bind", "127.0.0.1:0",
                                   "--run-dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            address = wait_for_address(Path(tmp) / "syncer.json", syncer)
            with ddiloco.session(session_model, session_opt, syncer=address, learner_id=0, config=run_config,
                                 handle_sigterm=False) as sync:
                timed_steps(session_model, session_opt, loss_of, batches[:10], sync)
                bare, wrapped = [], []
                for _ in range(repeats):
                    bare.append(timed_steps(bare_model, bare_opt, loss_of, batches))
                    wrapped.append(timed_steps(session_model, session_opt, loss_of, batches, sync))
                rounds = sum(sync.learner.versions)
        finally:
            os.killpg(syncer.pid, signal.SIGTERM)
            syncer.wait(timeout=60)
    b, w = statistics.median(bare), statistics.median(wrapped)
    print(f"{name:8s} bare {b:7.1f} steps/s  session {w:7.1f} steps/s  ratio {w / b:.3f}  "
          f"(median of {repeats} x {steps} steps; each: bare {[round(x, 1) for x in bare]}, "
          f"session {[round(x, 1) for x in wrapped]}; {rounds} rounds committed, as the learner saw them)")
    return b, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=("tinygpt", "gpt2", "both"), default="both")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("tinygpt", "gpt2") if args.model == "both" else (args.model,):
        bench(name, args.steps, args.repeats)


if __name__ == "__main__":
    main()
