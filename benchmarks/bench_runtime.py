"""Runtime benchmarks (issue: the real runtime). Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_runtime.py [--only NAME] [--learners 4] [--inner-steps 300]

`main` runs every `bench_*` function of this module (or only `--only NAME`), passing each the
command-line values its signature names.

- `bench_run_inner_steps`: learner inner steps per second inside `ddiloco run` (M learner processes
  plus the syncer, gRPC, checkpoints, status files, the waiting rule) against M bare training loops
  of the same model with the same torch thread count, run as M processes at once, each in its own
  session like a learner, so both get the same share of the cores. Phases alternate bare, run,
  bare so a change in the machine's background load shows up as a gap between the two bare figures.
  Target ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOW = (0.1, 0.9)
"""Rates are measured between these fractions of the inner steps: start-up and the last rounds
(when learners leave) are not steady state."""
READY_TIMEOUT_S = 300.0


def steady_rate(points: list[tuple[int, float]], total: int) -> float:
    """Inner steps per second between WINDOW fractions of `total`, from (inner_step, time) samples."""
    low, high = WINDOW[0] * total, WINDOW[1] * total
    inside = [(s, t) for s, t in sorted(points) if low <= s <= high]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        raise RuntimeError(f"too few samples between inner steps {low:.0f} and {high:.0f}: {len(inside)}")
    (s0, t0), (s1, t1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def bare_worker(shard: int, num_shards: int, steps: int) -> None:
    """One bare loop (a child process of `bare_rates`): prints "ready", waits for a line on stdin,
    trains, prints its (inner_step, time) samples as JSON."""
    import torch

    from ddiloco.data import load_corpus, shard_stream
    from ddiloco.model import build_model
    from ddiloco.run_config import RunConfig
    from ddiloco.training import inner_step, make_inner_optimizer

    config = RunConfig()
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    optimizer = make_inner_optimizer(model, config.inner)
    stream = shard_stream(load_corpus(), config.data, shard=shard, num_shards=num_shards)
    print("ready", flush=True)
    sys.stdin.readline()
    points = []
    for step in range(1, steps + 1):
        inner_step(model, optimizer, stream.next_batch(), grad_clip=config.inner.grad_clip)
        points.append((step, time.time()))
    print(json.dumps(points), flush=True)


def bare_rates(learners: int, steps: int, threads: int) -> list[float]:
    """M bare loops of the default model at once; their steady inner steps/s.

    Each is a process in its own session with the same thread settings as a learner of `ddiloco run`:
    with Linux autogroup scheduling the CPU is shared per session, so bare loops sharing one session
    would get less of it than the learners do, and the comparison would flatter the runtime."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "BENCH_THREADS": str(threads)}
    workers = [subprocess.Popen([sys.executable, __file__, "bare-worker", str(i), str(learners), str(steps)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
                                start_new_session=True) for i in range(learners)]
    for worker in workers:
        assert worker.stdout.readline().strip() == "ready"
    for worker in workers:  # all start together, so each sees the same contention throughout
        worker.stdin.write("go\n")
        worker.stdin.flush()
    rates = []
    for worker in workers:
        points = [tuple(p) for p in json.loads(worker.stdout.readline())]
        worker.wait()
        rates.append(steady_rate(points, steps))
    return rates


def run_rates(learners: int, steps: int, threads: int) -> tuple[list[float], float]:
    """`ddiloco run` with the default model; each learner's steady inner steps/s and the wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        run_dir = Path(tmp) / "run"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "ddiloco.cli", "run", "--learners", str(learners),
                               "--inner-steps", str(steps), "--threads", str(threads), "--run-dir", str(run_dir),
                               "--no-progress", "--json"], cwd=REPO, capture_output=True, text=True)
        wall_s = time.monotonic() - start
        if done.returncode != 0:
            raise RuntimeError(f"ddiloco run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rates = []
        for learner_id in range(learners):
            points = []
            with (run_dir / "learners" / str(learner_id) / "metrics.jsonl").open() as file:
                for line in file:
                    record = json.loads(line)
                    if f"learner/{learner_id}/loss" in record:
                        points.append((int(record["step"]), float(record["time"])))
            rates.append(steady_rate(points, steps))
    return rates, wall_s


def bench_run_inner_steps(learners: int = 4, inner_steps: int = 300, threads: int | None = None) -> None:
    threads = threads or max(1, (os.cpu_count() or 1) // learners)
    print(f"inner steps/s per learner, default model, {learners} learners x {threads} thread(s), "
          f"{inner_steps} inner steps, steady window {WINDOW[0]:.0%}-{WINDOW[1]:.0%}:")
    bare_before = bare_rates(learners, inner_steps, threads)
    inside, wall_s = run_rates(learners, inner_steps, threads)
    bare_after = bare_rates(learners, inner_steps, threads)
    bare = statistics.mean(bare_before + bare_after)
    run = statistics.mean(inside)
    print(f"  bare loops (before): {' '.join(f'{r:.2f}' for r in bare_before)}")
    print(f"  inside ddiloco run:  {' '.join(f'{r:.2f}' for r in inside)}  (run wall time {wall_s:.1f} s)")
    print(f"  bare loops (after):  {' '.join(f'{r:.2f}' for r in bare_after)}")
    print(f"  ratio run / bare = {run:.2f} / {bare:.2f} = {run / bare:.3f} (target >= 0.95)")


FRAGMENT_BYTES_PER_RUN = 1 << 30
"""Bytes of fragments streamed per throughput measurement (1 GiB)."""


def _fragment_tensors(case: str):
    """(params, DilocoConfig) of a throughput case: the default TinyGPT cut into its 4 fragments
    (about 0.48 MB each), or one 64 MiB tensor (a fragment of a large model)."""
    import torch

    from ddiloco.config import DilocoConfig
    from ddiloco.model import build_model

    if case == "default":
        torch.manual_seed(0)
        return {n: p.detach().clone() for n, p in build_model().named_parameters()}, DilocoConfig()
    generator = torch.Generator().manual_seed(0)
    return ({"weight": torch.randn(16 << 20, generator=generator)},
            DilocoConfig(num_fragments=1, fragment_strategy="single"))


def _fragment_server(case: str, count: int, port_queue, stop) -> None:
    """A gRPC server process whose Subscribe streams `count` FragmentStates (the real encoder and
    Subscription; no Syncer core, so only transport costs are measured)."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.fragments import FragmentPlan
    from ddiloco.messages import FragmentState, ModelSpec
    from ddiloco.transport.grpc_codec import WireModel
    from ddiloco.transport.grpc_server import start_server
    from ddiloco.transport.subscription import Subscription

    params, config = _fragment_tensors(case)
    plan = FragmentPlan.for_tensors(params, config)
    states = [FragmentState(p, 1, {n: params[n] for n in plan.fragments[p]}) for p in range(plan.num_fragments)]

    model = WireModel(ModelSpec.from_named_tensors(params.items()), plan, config.codec)

    class Handler:
        def wire_model(self):
            return model

        def join(self, join, diloco_config, peer, session=""):
            subscription = Subscription(join.learner_id)

            def feed() -> None:
                # A subscription keeps only the newest unsent state of a fragment, so putting them all at once
                # would collapse them: stay ahead of the stream by up to one state of every other fragment.
                ahead = max(1, len(states) - 1)
                for i in range(count):
                    while subscription.pending() >= ahead and not subscription.closed:
                        time.sleep(1e-4)
                    # A new message each time, as each round's broadcast is: the server encodes a message once and
                    # shares its chunks between the streams that send it (`SharedChunks`).
                    subscription.put(dataclasses.replace(states[i % len(states)]))
                subscription.close()

            threading.Thread(target=feed, daemon=True).start()
            return subscription

        def subscription_ended(self, subscription):
            pass

        def record_rejection(self, reason, detail, *, learner_id, peer, **fields):
            print(f"server rejected: {reason} {detail}", file=sys.stderr)

    server, port = start_server(Handler(), "127.0.0.1:0", token=None)
    port_queue.put(port)
    stop.wait()
    server.stop(0)


def bench_grpc_fragment_throughput() -> None:
    """Fragments (float32 global values) streamed by the syncer's server to a learner's client over
    loopback gRPC, server and client in two processes: encode, 1 MiB chunks, HTTP/2, reassembly into
    tensors. Target >= 0.4 GB/s."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.fragments import FragmentPlan
    from ddiloco.messages import FragmentState, Join, ModelSpec
    from ddiloco.transport.grpc_client import SyncerClient
    from ddiloco.transport.grpc_codec import WireModel

    print("fragment throughput over gRPC on 127.0.0.1 (server and client in separate processes):")
    for case in ("default", "large"):
        params, config = _fragment_tensors(case)
        plan = FragmentPlan.for_tensors(params, config)
        fragment_bytes = sum(params[n].numel() * 4 for n in plan.fragments[0])
        count = max(plan.num_fragments, FRAGMENT_BYTES_PER_RUN // fragment_bytes)
        context = multiprocessing.get_context("spawn")
        port_queue, stop = context.Queue(), context.Event()
        server = context.Process(target=_fragment_server, args=(case, count, port_queue, stop))
        server.start()
        try:
            port = port_queue.get(timeout=READY_TIMEOUT_S)
            spec = ModelSpec.from_named_tensors(params.items())
            client = SyncerClient(f"127.0.0.1:{port}", model=WireModel(spec, plan, config.codec), diloco_config=config)
            received = 0
            start = None
            for message, _ in client.subscribe(Join(0, spec, config.fingerprint())):
                if start is None:  # from the first whole message: excludes connection setup
                    start = time.perf_counter()
                    continue
                assert isinstance(message, FragmentState)
                received += message.payload_bytes
            seconds = time.perf_counter() - start
            client.close()
        finally:
            stop.set()
            server.join()
        print(f"  {case:>7}: {count - 1} fragments of {fragment_bytes / 1e6:.2f} MB in {seconds:.2f} s = "
              f"{received / seconds / 1e9:.2f} GB/s (target >= 0.4)")


def _wait_for(condition, what: str, timeout_s: float = READY_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def bench_learner_recovery(repeats: int = 3) -> None:
    """Time from `kill -9` of a learner to its next accepted update, restarting it at once (as a
    supervisor without backoff would): process start, checkpoint load, join (Welcome), the inner
    steps until its next round is due, the upload. Default model, 2 learners, 1 thread each.
    Target < 10 s."""
    print(f"learner recovery, default model, 2 learners x 1 thread, {repeats} kills:")
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        flags = ["--run-dir", str(run_dir), "--learners", "2", "--inner-steps", "1000000000"]
        base = [sys.executable, "-m", "ddiloco.cli"]
        logs = open(Path(tmp) / "processes.log", "ab")  # noqa: SIM115 - closed in finally
        popens: list[subprocess.Popen] = []

        def start(*args: str) -> subprocess.Popen:
            popen = subprocess.Popen([*base, *args], cwd=REPO, env=env, stdout=logs, stderr=logs)
            popens.append(popen)
            return popen

        def learner(learner_id: int) -> subprocess.Popen:
            return start("learner", "--syncer", address, "--learner-id", str(learner_id), *flags,
                         "--threads", "1", "--status-every-s", "0.1")

        def status(learner_id: int) -> dict:
            return _read(run_dir / "learners" / str(learner_id) / "status.json")

        try:
            syncer = start("syncer", *flags)
            address = _wait_for(lambda: _read(run_dir / "syncer.json").get("address"), "the syncer")
            victim = learner(0)
            learner(1)
            times = []
            checkpoints = run_dir / "learners" / "0" / "checkpoint"
            for _ in range(repeats):
                _wait_for(lambda v=victim: status(0).get("pid") == v.pid and status(0).get("updates_accepted", 0) > 2
                          and any(checkpoints.glob("state_*.json")), "learner 0 contributing")
                victim.kill()
                killed_at = time.monotonic()
                victim.wait()
                victim = learner(0)
                # The restarted process counts on from its checkpoint's counters: its own first
                # accepted update is the first count above them.
                newest = max(checkpoints.glob("state_*.json"))
                restored = json.loads(newest.read_text())["meta"]["counters"]["updates_accepted"]
                _wait_for(lambda v=victim, r=restored: status(0).get("pid") == v.pid
                          and status(0)["updates_accepted"] > r, "an accepted update of the restarted learner")
                times.append(time.monotonic() - killed_at)
            syncer.terminate()
        finally:
            for popen in popens:
                if popen.poll() is None:
                    popen.kill()
                popen.wait()
            logs.close()
    print(f"  kill -9 -> next accepted update: {' '.join(f'{t:.1f}' for t in times)} s "
          f"(median {statistics.median(times):.1f} s, target < 10)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="run only this bench_* function")
    parser.add_argument("--learners", type=int, default=None)
    parser.add_argument("--inner-steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    benches = {name: fn for name, fn in sorted(globals().items()) if name.startswith("bench_") and callable(fn)}
    if args.only is not None:
        if args.only not in benches:
            parser.error(f"--only {args.only}: no such benchmark (have {', '.join(benches)})")
        benches = {args.only: benches[args.only]}
    for name, bench in benches.items():
        accepted = inspect.signature(bench).parameters
        kwargs = {k: v for k, v in vars(args).items() if k in accepted and v is not None}
        print(f"== {name}")
        bench(**kwargs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["bare-worker"]:
        import torch

        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
        bare_worker(*(int(a) for a in sys.argv[2:5]))
    else:
        main()
