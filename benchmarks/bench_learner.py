"""How long a publish blocks the training thread, as a share of the inner step (issue 14 item 3).

P = H = 8, so a fragment falls due at every inner step: the worst case for the training loop. For each model
size (TinyGPT at 0.5 M, 13 M and 57 M parameters) one run measures, side by side:

- **blocked, inline**: the training thread's time per publish when it takes the pseudo-gradient and encodes
  it itself (`Learner.deferred = False`, what the in-process hub still does and the gRPC session did before);
- **blocked, deferred**: the same with the `Publisher` (`Learner.deferred = True`): the training thread only
  copies the fragment and queues it; target: at most 1 % of the inner step at every size. Wall time (what
  the loop loses), and the training thread's own CPU time in it (on a loaded machine the wall time of a
  sub-millisecond call is mostly time the thread spent descheduled);
- **inner step, idle / in flight**: one inner step (forward, backward, AdamW) with no publish being encoded,
  and with the previous step's publish being encoded on the publisher's thread meanwhile (the two
  alternate, so a machine whose load changes hurts both alike);
- **receive**: the training thread's time to take the round's result, as the syncer sends it by default (the
  fragment's change, int8, `ddiloco.downlink.DeltaDownlink`): rebuilt from the learner's base, its checksum
  checked, made the new base and written into the model with the steps trained since the publish kept on top
  (`keep_overlap_work`). Until 2026-12-07 the benchmark answered in float32 and did not time this half.

The transport is left out (the publisher hands updates to a sink): what is measured is the learner's own work.

    .venv/bin/python benchmarks/bench_learner.py [--sizes 0.5M,13M,57M] [--steps 6] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddiloco.config import DilocoConfig
from ddiloco.downlink import Downlink, make_downlink
from ddiloco.learner import Learner
from ddiloco.messages import FragmentState
from ddiloco.model import ModelConfig, build_model, count_parameters
from ddiloco.publisher import Publisher

SIZES = {
    "0.5M": ModelConfig(),
    "13M": ModelConfig(width=512, num_layers=4, num_heads=8),
    "57M": ModelConfig(width=768, num_layers=8, num_heads=12),
}
"""TinyGPT shapes at the issue's three sizes (count_parameters prints the exact figure)."""
FRAGMENTS = 8
BATCH, CONTEXT = 4, 128
"""A small batch: a shorter inner step makes the blocked share larger, so this errs on the pessimistic side."""


def synchronize(device: torch.device) -> None:
    """Wait for the training stream only: the publisher's side stream (its encoding) runs on past this."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def joined_learner(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, deferred: bool) -> Learner:
    learner = Learner(DilocoConfig(num_fragments=FRAGMENTS, sync_every=FRAGMENTS), learner_id=0, model=model,
                      optimizer=optimizer)
    params = dict(model.named_parameters())
    for p, names in enumerate(learner.plan.fragments):
        learner._apply(FragmentState(p, 0, {n: params[n].detach().to(torch.float32, copy=True) for n in names}),
                       force=True)
    learner.joined = True
    learner.deferred = deferred
    return learner


def downlink_of(learner: Learner) -> Downlink:
    """The syncer's side of the run's default downlink (`DilocoConfig.downlink_codec`), for `learner`'s fragments."""
    shapes = {name: tuple(param.shape) for name, param in learner.model.named_parameters()}
    return make_downlink(learner.config.downlink_codec, learner.plan, shapes)


def answer(learner: Learner, updates: list, downlink: Downlink) -> float:
    """The syncer's result for each update, at once: the fragment's next version (its value as the learner holds it),
    sent as the syncer sends it (`downlink`: by default its change, int8); the training thread's seconds in
    `receive` (the syncer's part is not timed). A fragment due while its last update's result is still owed waits
    for it (since 2026-12-05), so without results each fragment was published once and every later step measured
    nothing."""
    params = dict(learner.model.named_parameters())
    seconds = 0.0
    for update in updates:
        p = update.fragment
        names = learner.plan.fragments[p]
        global_p = {n: learner.local.base[p][n].to("cpu", copy=True) for n in names}  # the syncer's, bit for bit
        previous = downlink.before_step(p, global_p)
        for n in names:
            global_p[n].copy_(params[n].detach())
        message = downlink.after_step(p, update.base_version + 1, previous, global_p)
        started = time.perf_counter()
        learner.receive(message)
        synchronize(params[names[0]].device)
        seconds += time.perf_counter() - started
        assert learner.versions[p] == update.base_version + 1, "the change was not rebuilt (a checksum miss?)"
    return seconds


def measure(name: str, config: ModelConfig, steps: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = build_model(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, config.vocab_size, (BATCH, CONTEXT), device=device)

    def inner_step() -> float:
        started = time.perf_counter()
        loss = model(batch, batch)[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        synchronize(device)
        return time.perf_counter() - started

    inner_step()  # warm-up: first-call allocations
    sent = []
    publisher = Publisher(sent.append, on_sent=lambda update: None)
    deferred = joined_learner(model, optimizer, deferred=True)
    inline = joined_learner(model, optimizer, deferred=False)
    deferred_downlink, inline_downlink = downlink_of(deferred), downlink_of(inline)
    idle_s, in_flight_s, blocked_deferred_s, blocked_inline_s, receive_s = [], [], [], [], []
    cpu_deferred_s: list[float] = []
    for i in range(2 * steps):
        in_flight = i % 2 == 1  # the publish queued at the end of the previous step is being encoded meanwhile
        if not in_flight:
            publisher.drain()  # nothing being encoded during this step
        (in_flight_s if in_flight else idle_s).append(inner_step())
        if not in_flight:
            started = time.perf_counter()
            published = inline.after_inner_step(BATCH * CONTEXT)  # encodes on this thread, as before the publisher
            synchronize(device)
            blocked_inline_s.append(time.perf_counter() - started)
            assert len(published) == 1, "every step publishes one fragment (P = H)"
            answer(inline, published, inline_downlink)
        started, cpu_started = time.perf_counter(), time.thread_time()
        published = deferred.after_inner_step(BATCH * CONTEXT)
        for update in published:
            publisher.send(update)
        synchronize(device)
        blocked_deferred_s.append(time.perf_counter() - started)
        cpu_deferred_s.append(time.thread_time() - cpu_started)
        receive_s.append(answer(deferred, published, deferred_downlink))
    publisher.close(60.0)
    assert len(sent) == 2 * steps and all(len(update.payload) > 0 for update in sent)
    step_s = statistics.median(idle_s)
    return {"size": name, "parameters": count_parameters(model), "inner_step_idle_s": step_s,
            "inner_step_in_flight_s": statistics.median(in_flight_s),
            "blocked_inline_s": statistics.median(blocked_inline_s),
            "blocked_deferred_s": statistics.median(blocked_deferred_s),
            "blocked_deferred_cpu_s": statistics.median(cpu_deferred_s),
            "blocked_inline_share": statistics.median(blocked_inline_s) / step_s,
            "blocked_deferred_share": statistics.median(blocked_deferred_s) / step_s,
            "receive_s": statistics.median(receive_s), "receive_share": statistics.median(receive_s) / step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--steps", type=int, default=6, help="measured inner steps per mode and size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [measure(name, SIZES[name], args.steps, device) for name in args.sizes.split(",")]
    print(f"P = H = {FRAGMENTS} (a publish every inner step), batch {BATCH} x {CONTEXT} tokens, {device}, "
          f"{args.threads} thread(s), medians of {args.steps} steps")
    print(f"{'size':>6} {'params':>11} {'step idle':>10} {'in flight':>10} {'inline':>9} {'share':>7} "
          f"{'deferred':>9} {'share':>7} {'its CPU':>8} {'receive':>9} {'share':>7}  target <= 1 % (publish)")
    for r in rows:
        verdict = "ok" if r["blocked_deferred_share"] <= 0.01 else "MISSED"
        print(f"{r['size']:>6} {r['parameters']:>11,} {r['inner_step_idle_s'] * 1e3:>8.1f}ms "
              f"{r['inner_step_in_flight_s'] * 1e3:>8.1f}ms {r['blocked_inline_s'] * 1e3:>7.2f}ms "
              f"{r['blocked_inline_share']:>6.1%} {r['blocked_deferred_s'] * 1e3:>7.2f}ms "
              f"{r['blocked_deferred_share']:>6.2%} {r['blocked_deferred_cpu_s'] * 1e3:>6.2f}ms "
              f"{r['receive_s'] * 1e3:>7.2f}ms {r['receive_share']:>6.2%}  {verdict}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
