"""Many lightweight learners against one real syncer process over gRPC on 127.0.0.1 (issue 16). Prints figures;
run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_fleet.py [--learners 128] [--processes 4] [--rounds 24] [--values 65536]

The syncer is `ddiloco syncer` itself (its own process, `--threads 1`). The learners send valid updates of a
small model (`fragments` tensors of `values` float32 each, one per fragment, int4 uplink, int8 downlink) but
do not train: each is an asyncio task with its own gRPC channel, `learners / processes` of them per process
(128 Python processes with torch do not fit 2 shared cores and 24 GiB). Round r is fragment r mod P: every
learner pushes its update from the version it holds, then waits for the next version; the quorum is every
learner (grace none), so a round closes with its last update.

Printed: whether every learner received every version; per round, the time from the round's close (its
`closed_at` in the round log, the syncer's monotonic clock, which every process on the host shares) to the
last learner holding the new version, as median and maximum; the syncer's memory (VmRSS) after the
learners joined and after the rounds; the rounds' rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_cache: dict = {}
READY_TIMEOUT_S = 300.0
ROUND_TIMEOUT_S = 120.0
TOKENS = 4096


def _model(fragments: int, values: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    return {f"layer{p}.weight": torch.randn(values, generator=generator) * 0.02 for p in range(fragments)}


def _run_config(learners: int, fragments: int):
    from ddiloco.config import DilocoConfig, QuorumConfig
    from ddiloco.run_config import RunConfig

    # Every learner is the quorum; no heartbeats needed within the run (they would be 128 extra calls a second).
    return RunConfig(num_learners=learners, diloco=DilocoConfig(num_fragments=fragments, codec="int4"),
                     quorum=QuorumConfig(min_quorum=learners, grace="none", heartbeat_timeout_s=600.0))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _learner(learner_id: int, address: str, args, start, arrivals: dict) -> None:
    import grpc

    from ddiloco.compression import get_codec
    from ddiloco.fragments import FragmentPlan
    from ddiloco.messages import SCHEMA_VERSION, FragmentDelta, FragmentState, Join, ModelSpec, Update, Welcome
    from ddiloco.transport import wire_pb2_grpc
    from ddiloco.transport.grpc_codec import WireModel, encode_join, encode_update
    from ddiloco.transport.grpc_common import CHANNEL_OPTIONS, SCHEMA_KEY
    from ddiloco.transport.syncer_stream import SyncerStreamDecoder

    config = _run_config(args.learners, args.fragments)
    if "params" not in _cache:  # one model and one set of payloads per process, shared by its learners
        _cache["params"] = _model(args.fragments, args.values)
    params = _cache["params"]
    spec = ModelSpec.from_named_tensors(params.items())
    plan = FragmentPlan.for_tensors(params, config.diloco)
    model = WireModel(spec, plan, config.diloco.codec, config.diloco.downlink_codec)
    if "payloads" not in _cache:
        codec = get_codec(config.diloco.codec)
        _cache["payloads"] = [{n: codec.encode(params[n] * 1e-3) for n in names} for names in plan.fragments]
    payloads = _cache["payloads"]
    metadata = ((SCHEMA_KEY, str(SCHEMA_VERSION)),)
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = wire_pb2_grpc.SyncerStub(channel)
    versions: dict[int, int] = {}
    changed = asyncio.Condition()
    call = stub.Subscribe(encode_join(Join(learner_id, spec, config.diloco.fingerprint()), config.diloco),
                          metadata=metadata)

    async def read() -> None:
        decoder = SyncerStreamDecoder(model)
        async for chunk in call:
            message = decoder.feed(chunk)
            if message is None:
                continue
            now = time.monotonic()
            async with changed:
                if isinstance(message, Welcome):
                    versions.update({s.fragment: s.version for s in message.fragments})
                elif isinstance(message, FragmentState | FragmentDelta):
                    versions[message.fragment] = message.version
                    arrivals.setdefault((message.fragment, message.version), []).append(now)
                changed.notify_all()

    reader = asyncio.ensure_future(read())
    try:
        async with changed:
            await asyncio.wait_for(changed.wait_for(lambda: len(versions) == plan.num_fragments), READY_TIMEOUT_S)
        await start
        for r in range(args.rounds):
            p = r % plan.num_fragments
            base = versions[p]
            update = Update(learner_id, p, base, r + 1, 1, TOKENS, config.diloco.codec, payloads[p])
            reply = await stub.PushUpdate(iter(list(encode_update(update, spec))), metadata=metadata)
            if not reply.accepted:
                raise RuntimeError(f"learner {learner_id} round {r}: {reply.reason} {reply.detail}")
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda p=p, base=base: versions[p] > base), ROUND_TIMEOUT_S)
    finally:
        reader.cancel()
        await channel.close()


def _client_process(first: int, count: int, address: str, args, ready, go, out) -> None:
    import torch

    torch.set_num_threads(1)

    async def main() -> dict:
        arrivals: dict = {}
        loop = asyncio.get_running_loop()
        start = loop.create_future()
        tasks = [asyncio.ensure_future(_learner(i, address, args, start, arrivals))
                 for i in range(first, first + count)]
        ready.set()
        await loop.run_in_executor(None, go.wait)
        start.set_result(None)
        await asyncio.gather(*tasks)
        return arrivals

    arrivals = asyncio.run(main())
    out.put({f"{p},{v}": times for (p, v), times in arrivals.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=128)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--values", type=int, default=65536, help="float32 values per fragment")
    args = parser.parse_args()
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        run_dir, init = Path(tmp) / "run", Path(tmp) / "init.safetensors"
        run_dir.mkdir()
        _run_config(args.learners, args.fragments).save(run_dir / "config.json")
        save_file(_model(args.fragments, args.values), str(init))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        log = (Path(tmp) / "syncer.log").open("w")
        syncer = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "syncer", "--run-dir", str(run_dir),
                                   "--bind", "127.0.0.1:0", "--allow-no-token", "--init", str(init), "--threads", "1"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (run_dir / "syncer.json").exists():
                if syncer.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the syncer did not start: {(Path(tmp) / 'syncer.log').read_text()}")
                time.sleep(0.1)
            address = json.loads((run_dir / "syncer.json").read_text())["address"]
            rss_start = rss_mib(syncer.pid)
            context = multiprocessing.get_context("spawn")
            go, out = context.Event(), context.Queue()
            per = -(-args.learners // args.processes)
            clients, readies = [], []
            for k in range(args.processes):
                first, count = k * per, min(per, args.learners - k * per)
                ready = context.Event()
                client = context.Process(target=_client_process, args=(first, count, address, args, ready, go, out))
                client.start()
                clients.append(client)
                readies.append(ready)
            status = run_dir / "syncer_status.json"
            while True:  # every learner joined (a round must not close with fewer)
                alive = json.loads(status.read_text()).get("alive_learners", []) if status.exists() else []
                if len(alive) == args.learners:
                    break
                if time.monotonic() > deadline or any(c.exitcode not in (None, 0) for c in clients):
                    raise SystemExit(f"only {len(alive)} of {args.learners} learners joined")
                time.sleep(0.2)
            rss_joined = rss_mib(syncer.pid)
            started = time.monotonic()
            go.set()
            merged: dict[str, list[float]] = {}
            for _ in clients:
                for key, times in out.get(timeout=args.rounds * ROUND_TIMEOUT_S).items():
                    merged.setdefault(key, []).extend(times)
            elapsed = time.monotonic() - started
            rss_end = rss_mib(syncer.pid)
            for client in clients:
                client.join(timeout=READY_TIMEOUT_S)
        finally:
            syncer.terminate()
            syncer.wait(timeout=READY_TIMEOUT_S)
            log.close()
        rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]
    delays, complete = [], True
    for record in rounds:
        times = merged.get(f"{record['fragment']},{record['version']}", [])
        complete &= len(times) == args.learners
        if times:
            delays.append(max(times) - record["closed_at"])
    print(f"{args.learners} learners (asyncio, {args.processes} processes) against one syncer process, "
          f"{args.fragments} fragments of {args.values:,} values, int4 up, int8 down, torch {torch.__version__}")
    print(f"  rounds committed {len(rounds)} of {args.rounds}; every learner received every version: "
          f"{complete and len(rounds) == args.rounds}")
    if delays:
        print(f"  round close -> last learner holding it: median {statistics.median(delays) * 1e3:.0f} ms, "
              f"max {max(delays) * 1e3:.0f} ms")
    print(f"  {len(rounds) / elapsed:.2f} rounds/s ({len(rounds) * args.learners / elapsed:.0f} updates/s)")
    print(f"  syncer VmRSS: {rss_start:.0f} MiB at start, {rss_joined:.0f} MiB with every learner joined, "
          f"{rss_end:.0f} MiB after the rounds")


if __name__ == "__main__":
    main()
