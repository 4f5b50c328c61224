"""A link whose round trip is long (a learner across an ocean, behind a satellite hop, a TLS handshake on a slow
path).

A connection attempt is given `grpc_common.MIN_CONNECT_TIMEOUT_MS` to finish its handshake. Until 2026-12-07
the channel options set `grpc.min_reconnect_backoff_ms`, which gRPC core takes as the least time an attempt is given
(not a pause between attempts), to 100 ms: each attempt was cut after at most about 2.4 s, the longest backoff, so a
handshake slower than that never finished (a probe: over TLS at a 1.2 s round trip both learners exited
`unreachable`).

The syncer's step time, of which every round's grace window is made, is the one the learners time, their waits for
results left out (`Update.step_time_s`). Until 2026-12-07 it was the spacing of each learner's updates, which those
waits stretch: behind a long round trip a learner waits at most publishes, and the run's step time came out many times
its real one, every grace window at its cap.

Real gRPC on 127.0.0.1 through a real TCP proxy that holds the bytes back; real `ddiloco` processes for the second.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent import futures

import grpc
import pytest

from ddiloco.checkpoint import read_json
from ddiloco.transport import grpc_common
from tests.helpers import TINY_MODEL_FLAGS, Processes, wait_until
from tests.proxies import DelayingProxy

pytestmark = pytest.mark.integration

SERVER_DELAY_S = 3.0
"""How long the proxy holds every byte from the server: longer than the longest reconnect backoff (2 s + 20 %)."""


def test_a_handshake_slower_than_the_reconnect_backoff_still_connects():
    server = grpc.server(futures.ThreadPoolExecutor(2), options=grpc_common.CHANNEL_OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = DelayingProxy(("127.0.0.1", port), to_client_s=SERVER_DELAY_S)
    channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=grpc_common.CHANNEL_OPTIONS)
    try:
        started = time.monotonic()
        grpc.channel_ready_future(channel).result(timeout=4 * SERVER_DELAY_S)
        assert time.monotonic() - started >= SERVER_DELAY_S
    finally:
        channel.close()
        server.stop(None)
        proxy.close()


ONE_WAY_S = 0.25
"""Each direction's latency on the far link: a 0.5 s round trip, many of the tiny model's inner steps."""
FAR_RUN = (*TINY_MODEL_FLAGS, "--learners", "1", "--num-fragments", "2", "--sync-every", "8")


@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(240)
def test_the_syncers_step_time_leaves_out_the_waits_a_long_round_trip_makes(tmp_path, procs: Processes):
    run_dir = tmp_path / "run"
    syncer = procs.start("syncer", "syncer", "--bind", "127.0.0.1:0", "--run-dir", str(run_dir), "--allow-no-token",
                         *FAR_RUN)
    address = wait_until(lambda: read_json(run_dir / "syncer.json"), "syncer.json", alive=[syncer])["address"]
    host, port = address.rsplit(":", 1)
    proxy = DelayingProxy((host, int(port)), to_client_s=ONE_WAY_S, to_server_s=ONE_WAY_S)
    try:
        learner = procs.start("learner", "learner", "--syncer", f"127.0.0.1:{proxy.port}", "--learner-id", "0",
                              "--run-dir", str(run_dir), "--threads", "1", "--inner-steps", "48", *FAR_RUN)
        learner.wait(timeout=180)
        assert learner.returncode == 0, procs.log("learner")
        metrics = [json.loads(line) for path in run_dir.rglob("metrics.jsonl") for line in path.open()]
        steps = [m["learner/0/step_s"] for m in metrics if "learner/0/step_s" in m]
        waits = [m["learner/0/wait_s"] for m in metrics if "learner/0/wait_s" in m]
        status = wait_until(lambda: (read_json(run_dir / "syncer_status.json") or {}).get("step_time_s"),
                            "the syncer's step time", alive=[syncer])
    finally:
        proxy.close()
    compute_s = statistics.fmean(steps)
    # The learner waited for results far longer than it trained: the spacing of its updates is mostly waiting.
    assert sum(waits) > 4 * sum(steps), (sum(waits), sum(steps))
    assert compute_s / 3 < status < 3 * compute_s, (status, compute_s)
