"""Quality of the defaults on a model that is not TinyGPT (issue 12). Prints figures; run by hand.

    .venv/bin/python benchmarks/bench_quality.py                       # defaults vs plain AdamW (~1 min)
    .venv/bin/python benchmarks/bench_quality.py --grid 1.0:0.0 0.7:0.9 0.5:0.5   # outer lr:momentum sweep

The model and task are `examples/mlp.py`'s (a small MLP regressing a fixed random teacher network; each
learner draws its own inputs). M learners train in one process through `ddiloco.InProcessHub` with the
user's plain loop, taking turns on a virtual clock (one second per inner step), so they start together,
run at one speed and the run is the same on every machine: this measures the algorithm, not the
transport. The baseline is plain AdamW on the union of the shards at equal samples:
one model, batch M x B, the same number of steps (what data-parallel training computes). Both are
evaluated on the example's held-out set every `--eval-every` steps; the run's global model is the
syncer's.

Acceptance (issue 12): with the defaults the validation loss falls monotonically (smoothed over 3
evaluations) and ends within 5 % of plain AdamW.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import mlp  # noqa: E402  (examples/mlp.py)

import ddiloco  # noqa: E402
from ddiloco.clock import VirtualClock  # noqa: E402

TOLERANCE = 0.05


def evaluate_params(params: dict[str, torch.Tensor]) -> float:
    model = mlp.build_model()
    model.load_state_dict(params)
    return mlp.evaluate(model)["val_loss"]


def run_diloco(config: ddiloco.DilocoConfig, *, learners: int, steps: int, lr: float, eval_every: int,
               seed: int) -> list[float]:
    clock = VirtualClock()  # one virtual second per inner step: the run does not depend on this machine's load
    hub = ddiloco.InProcessHub(config=config, quorum=ddiloco.QuorumConfig(min_quorum=1), clock=clock)
    sessions, streams = [], []
    for learner_id in range(learners):
        torch.manual_seed(seed)
        model = mlp.build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        sync = ddiloco.session(model, optimizer, hub=hub, learner_id=learner_id, inner_steps=steps, clock=clock)
        sync.start()
        sessions.append(sync)
        streams.append(mlp.TeacherData(shard=learner_id, seed=seed))
    curve = [evaluate_params(hub.syncer.global_params())]
    step = 0
    while not all(s.done for s in sessions):
        for sync, data in zip(sessions, streams, strict=True):
            if sync.done or not sync.ready:
                continue
            x, y = data.next_batch()
            loss = F.mse_loss(sync.model(x), y)
            sync.optimizer.zero_grad()
            loss.backward()
            sync.optimizer.step()
            sync.step(tokens=len(x), loss=loss.item())
        clock.advance_to(clock.now() + 1.0)
        hub.advance()
        step = min(s.inner_step for s in sessions)
        if step % eval_every == 0 and len(curve) <= step // eval_every:
            curve.append(evaluate_params(hub.syncer.global_params()))
    for sync in sessions:
        sync.close()
    curve.append(evaluate_params(hub.syncer.global_params()))
    return curve


def run_adamw(*, learners: int, steps: int, lr: float, eval_every: int, seed: int) -> list[float]:
    torch.manual_seed(seed)
    model = mlp.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    streams = [mlp.TeacherData(shard=m, seed=seed) for m in range(learners)]
    curve = [mlp.evaluate(model)["val_loss"]]
    for step in range(1, steps + 1):
        batches = [s.next_batch() for s in streams]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % eval_every == 0:
            curve.append(mlp.evaluate(model)["val_loss"])
    curve.append(mlp.evaluate(model)["val_loss"])
    return curve


def smoothed_monotone(curve: list[float]) -> bool:
    smooth = [sum(curve[i:i + 3]) / 3 for i in range(len(curve) - 2)]
    return all(b <= a for a, b in zip(smooth, smooth[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400, help="inner steps per learner")
    parser.add_argument("--lr", type=float, default=2e-3, help="inner AdamW learning rate (the example's)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", nargs="*", default=None, metavar="LR:MOMENTUM[:H]",
                        help="outer (lr, momentum[, sync_every]) to compare with the defaults")
    args = parser.parse_args()
    torch.set_num_threads(1)
    common = dict(learners=args.learners, steps=args.steps, lr=args.lr, eval_every=args.eval_every, seed=args.seed)
    start = time.perf_counter()
    baseline = run_adamw(**common)
    print(f"plain AdamW, batch {args.learners} x {mlp.BATCH_SIZE}: final {baseline[-1]:.4f}  "
          f"curve {' '.join(f'{v:.3f}' for v in baseline)}  ({time.perf_counter() - start:.0f} s)", flush=True)
    default = ddiloco.DilocoConfig()
    configs = [("defaults", default)]
    for spec in args.grid or ():
        lr, momentum, *rest = spec.split(":")
        config = dataclasses.replace(default, outer_lr=float(lr), outer_momentum=float(momentum),
                                     sync_every=int(rest[0]) if rest else default.sync_every)
        configs.append((spec, config))
    for name, config in configs:
        start = time.perf_counter()
        curve = run_diloco(config, **common)
        gap = curve[-1] / baseline[-1] - 1
        print(f"{name} (outer {config.outer_lr}, {config.outer_momentum}, H {config.sync_every}; "
              f"downlink {config.downlink_codec}): "
              f"final {curve[-1]:.4f} ({gap:+.1%} vs AdamW, within {TOLERANCE:.0%}: {gap <= TOLERANCE}; "
              f"falls monotonically, smoothed over 3: {smoothed_monotone(curve)})  "
              f"curve {' '.join(f'{v:.3f}' for v in curve)}  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
