"""`ddiloco syncer` as a real process: kill -9 and restart, heartbeat timeouts, clean stops.

Real processes (`python -m ddiloco.cli`), real gRPC on 127.0.0.1 with an ephemeral port, real signals.
Learners are told to train "forever" and are stopped with SIGTERM, so no assertion depends on how
fast this machine trains; every wait has a hard deadline, and the fixture kills every process it
started, by PID, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import defaultdict

import pytest
import torch

from ddiloco.checkpoint import load_latest_state, read_json
from ddiloco.round_log import RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.syncer import replay_rounds
from ddiloco.train_tinygpt import initial_params
from tests.helpers import (
    PROCESS_WAIT_S,
    TINY_MODEL_FLAGS,
    Processes,
    flip_bit_in_tensor_data,
    wait_until,
)

pytestmark = pytest.mark.integration

RUN_FLAGS = (*TINY_MODEL_FLAGS, "--learners", "2", "--inner-steps", "100000000", "--num-fragments", "2",
             "--sync-every", "8", "--max-wait-s", "0.5", "--heartbeat-timeout-s", "3", "--heartbeat-every-s", "0.5")
"""Two learners that never finish on their own (the tests stop them), a short waiting bound so they
train on while the syncer is away, and a heartbeat timeout of 3 s."""



def start_syncer(procs: Processes, run_dir, *extra: str, name: str = "syncer"):
    # Every round's file kept (--round-files all): these tests replay the whole log from the genesis.
    popen = procs.start(name, "syncer", "--run-dir", str(run_dir), *RUN_FLAGS,
                        "--full-state-every", "25", "--round-files", "all", *extra)
    info = wait_until(lambda: (i := read_json(run_dir / "syncer.json")) and i["pid"] == popen.pid and i,
                      "syncer.json", alive=[popen])
    return popen, info["address"]


def start_learner(procs: Processes, run_dir, address: str, learner_id: int, *extra: str):
    return procs.start(f"learner{learner_id}", "learner", "--syncer", address, "--learner-id", str(learner_id),
                       "--run-dir", str(run_dir), "--threads", "1", *extra)


def syncer_status(run_dir) -> dict:
    return read_json(run_dir / "syncer_status.json") or {}


def learner_status(run_dir, learner_id: int) -> dict:
    return read_json(run_dir / "learners" / str(learner_id) / "status.json") or {}


def stop(popen, what: str) -> None:
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=PROCESS_WAIT_S) == 0, f"{what} did not exit 0 on SIGTERM"


def assert_log_is_gapless(run_dir) -> list:
    """Every round once, in order, and every fragment's versions 1, 2, 3, ... without a gap."""
    records = list(RoundLog(run_dir).records())  # raises on a gap or a repeat in the round numbers
    versions: dict[int, list[int]] = defaultdict(list)
    for record in records:
        versions[record.fragment].append(record.version)
    for fragment, seen in versions.items():
        assert seen == list(range(1, len(seen) + 1)), f"fragment {fragment} versions {seen}"
    return records


def assert_state_equals_replay(run_dir, records) -> None:
    config = RunConfig.load(run_dir / "config.json")
    replayed = replay_rounds(config.diloco, initial_params(config), records)
    state, _, serial = load_latest_state(run_dir / "checkpoints" / "syncer")
    assert serial == len(records)
    for name, tensor in replayed.items():
        assert torch.equal(state["global"][name], tensor), name


@pytest.mark.timeout(300)  # several processes: minutes when the machine is loaded
def test_syncer_kill9_and_restart_loses_and_repeats_no_committed_round(tmp_path, procs):
    run_dir = tmp_path / "run"
    syncer, address = start_syncer(procs, run_dir)
    learners = [start_learner(procs, run_dir, address, i) for i in range(2)]
    wait_until(lambda: (s := syncer_status(run_dir)) and s["alive_learners"] == [0, 1] and s["rounds_committed"] >= 20,
               "both learners syncing", alive=[syncer, *learners])
    for i in range(2):
        wait_until(lambda i=i: learner_status(run_dir, i).get("state") in ("training", "waiting"),
                   f"learner {i} training", alive=[syncer, *learners])

    os.kill(syncer.pid, signal.SIGKILL)
    syncer.wait()
    committed = len(RoundLog(run_dir).lines())
    durable_versions = [0, 0]
    for line in RoundLog(run_dir).lines():
        durable_versions[line["fragment"]] = line["version"]
    held = {i: learner_status(run_dir, i) for i in range(2)}
    for status in held.values():  # Commit before Send: nobody holds a version the log does not
        assert all(v <= d for v, d in zip(status["versions"], durable_versions, strict=True))

    # The learners notice, and keep training within the waiting bound while the syncer is away.
    for i in range(2):
        wait_until(lambda i=i: not learner_status(run_dir, i).get("connected", True), f"learner {i} disconnected",
                   alive=learners)
    steps = {i: learner_status(run_dir, i)["inner_step"] for i in range(2)}
    for i in range(2):
        wait_until(lambda i=i: learner_status(run_dir, i)["inner_step"] >= steps[i] + 20,
                   f"learner {i} training without a syncer", alive=learners)

    restarted, _ = start_syncer(procs, run_dir, "--bind", address, name="syncer-restarted")
    wait_until(lambda: syncer_status(run_dir).get("pid") == restarted.pid, "status of the restarted syncer",
               alive=[restarted])
    # Both learners re-join by themselves (their second Welcome) and syncing resumes.
    for i in range(2):
        wait_until(lambda i=i: learner_status(run_dir, i).get("joins", 0) >= 2, f"learner {i} re-joined",
                   alive=[restarted, *learners])
    wait_until(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= committed + 10,
               "10 rounds after the restart", alive=[restarted, *learners])

    for i, learner in enumerate(learners):
        stop(learner, f"learner {i}")
    stop(restarted, "the restarted syncer")
    assert f"resumed at round {committed}" in procs.log("syncer-restarted")
    records = assert_log_is_gapless(run_dir)
    assert len(records) >= committed + 10
    assert_state_equals_replay(run_dir, records)
    for i in range(2):
        status = learner_status(run_dir, i)
        assert status["state"] == "stopped" and status["bytes_sent"] > 0 and status["bytes_received"] > 0


def silence_learner_1_until_it_is_timed_out(procs, run_dir, *syncer_flags: str):
    """A syncer (with `syncer_flags`) and learners 0 and 1; learner 1 SIGSTOPped until the syncer has timed it out
    and committed 10 rounds without it, then continued. Returns the syncer and the learners."""
    syncer, address = start_syncer(procs, run_dir, *syncer_flags)
    learners = [start_learner(procs, run_dir, address, i) for i in range(2)]
    wait_until(lambda: syncer_status(run_dir).get("alive_learners") == [0, 1], "both learners alive",
               alive=[syncer, *learners])
    # SIGSTOP keeps its connection open: only the missing heartbeats give it away.
    os.kill(learners[1].pid, signal.SIGSTOP)
    try:
        wait_until(lambda: syncer_status(run_dir).get("alive_learners") == [0], "learner 1 timed out",
                   alive=[syncer])
        rounds = syncer_status(run_dir)["rounds_committed"]
        wait_until(lambda: syncer_status(run_dir)["rounds_committed"] >= rounds + 10,
                   "rounds without the silent learner", alive=[syncer, learners[0]])
    finally:
        os.kill(learners[1].pid, signal.SIGCONT)
    return syncer, learners


@pytest.mark.acceptance  # 17 s: the default suite's time (the chaos runs' hang faults cover it there too)
@pytest.mark.timeout(300)  # several processes: minutes when the machine is loaded
def test_a_silent_learner_is_timed_out_and_rejoins_when_it_wakes(tmp_path, procs):
    run_dir = tmp_path / "run"
    syncer, learners = silence_learner_1_until_it_is_timed_out(procs, run_dir)
    wait_until(lambda: syncer_status(run_dir).get("alive_learners") == [0, 1], "learner 1 back",
               alive=[syncer, *learners])
    wait_until(lambda: learner_status(run_dir, 1).get("joins", 0) >= 2, "learner 1 re-joined", alive=learners)
    for i, learner in enumerate(learners):
        stop(learner, f"learner {i}")
    stop(syncer, "the syncer")
    assert_state_equals_replay(run_dir, assert_log_is_gapless(run_dir))


@pytest.mark.acceptance  # 20 s; the rule itself in the default suite (tests/unit/test_learner_rules.py)
@pytest.mark.timeout(300)
def test_a_live_learner_refuses_a_syncer_restarted_from_an_older_copy_of_its_run_directory(tmp_path, procs):
    # An operator restored a backup of the syncer's directory under a running learner: the learner joined again,
    # took the older state and trained on in silence, the rounds since lost (restarted, it was refused by its
    # checkpoint).
    run_dir, backup = tmp_path / "run", tmp_path / "backup"
    syncer, address = start_syncer(procs, run_dir)
    learner = start_learner(procs, run_dir, address, 0)
    wait_until(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= 10, "rounds", alive=[syncer, learner])
    stop(syncer, "the syncer")
    shutil.copytree(run_dir, backup, ignore=lambda directory, names: ["learners"] if directory == str(run_dir) else [])
    syncer, _ = start_syncer(procs, run_dir, "--bind", address, name="syncer-2")
    committed = len(RoundLog(backup).lines())
    wait_until(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= committed + 10, "rounds after the backup",
               alive=[syncer, learner])
    stop(syncer, "the syncer")
    for entry in run_dir.iterdir():
        if entry.name != "learners":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.copytree(backup, run_dir, dirs_exist_ok=True)
    syncer, _ = start_syncer(procs, run_dir, "--bind", address, name="syncer-3")
    assert learner.wait(timeout=PROCESS_WAIT_S) == 3, procs.log("learner0")[-3000:]
    assert "the syncer now holds version" in procs.log("learner0")
    status = learner_status(run_dir, 0)
    assert status["state"] == "refused" and status["checkpoint_inner_step"] == status["inner_step"], status
    stop(syncer, "the syncer")


@pytest.mark.acceptance  # 20 s; the rule itself in the default suite (tests/unit/test_learner_rules.py)
@pytest.mark.timeout(300)
def test_a_silent_learner_of_a_synchronous_run_rejoins_in_phase(tmp_path, procs):
    # Every round waits for every live learner (--min-quorum 2 of 2). The woken learner joined again at the position
    # it had, rounds it had not published committed without it: out of phase with the other, each round then waited
    # the learners' --max-wait-s (here 120 s, 60 s by default) for its update.
    run_dir = tmp_path / "run"
    syncer, learners = silence_learner_1_until_it_is_timed_out(procs, run_dir, "--min-quorum", "2",
                                                               "--max-wait-s", "120")
    wait_until(lambda: learner_status(run_dir, 1).get("joins", 0) >= 2, "learner 1 re-joined", alive=learners)
    rounds = syncer_status(run_dir)["rounds_committed"]
    wait_until(lambda: syncer_status(run_dir)["rounds_committed"] >= rounds + 10, "rounds with both learners again",
               alive=[syncer, *learners])
    for i, learner in enumerate(learners):
        stop(learner, f"learner {i}")
    stop(syncer, "the syncer")
    assert "re-joined behind the run" in procs.log("learner1")
    records = assert_log_is_gapless(run_dir)
    together = [r.round_index for r in records[rounds:rounds + 10] if {p.learner_id for p in r.participants} == {0, 1}]
    assert len(together) >= 5, records[rounds:rounds + 10]  # the rounds after the re-join merge both learners


@pytest.mark.acceptance  # 20 s; the wire's side of it runs in the default suite (test_bad_input.py)
@pytest.mark.timeout(300)
def test_a_learner_process_replaced_while_it_was_frozen_stops_when_it_wakes_and_keeps_off_the_checkpoint(
        tmp_path, procs):
    # Before: the frozen process, continued, pushed its update (merged beside the new process's, which trains the same
    # data), kept learner 1 alive with its heartbeats, and when refused on re-joining wrote its own checkpoint over the
    # learner directory the new process resumes from.
    run_dir = tmp_path / "run"
    syncer, address = start_syncer(procs, run_dir)
    no_periodic = ("--checkpoint-every-s", "100000")  # a checkpoint only at a process's end
    learners = [start_learner(procs, run_dir, address, i, *no_periodic) for i in range(2)]
    wait_until(lambda: syncer_status(run_dir).get("alive_learners") == [0, 1], "both learners alive",
               alive=[syncer, *learners])
    wait_until(lambda: learner_status(run_dir, 1).get("inner_step", 0) >= 16, "learner 1 trained",
               alive=[syncer, *learners])
    frozen = learners[1]
    os.kill(frozen.pid, signal.SIGSTOP)  # a paused VM: its connection stays open
    try:
        wait_until(lambda: syncer_status(run_dir).get("alive_learners") == [0], "learner 1 timed out",
                   alive=[syncer])
        replacement = procs.start("learner1-replacement", "learner", "--syncer", address, "--learner-id", "1",
                                  "--run-dir", str(run_dir), "--threads", "1", *no_periodic)
        wait_until(lambda: syncer_status(run_dir).get("alive_learners") == [0, 1], "the replacement joined",
                   alive=[syncer, replacement])
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert frozen.wait(timeout=PROCESS_WAIT_S) == 3  # refused
    log = procs.log("learner1")
    assert "this process (" in log and ") was replaced" in log, log[-2000:]
    assert load_latest_state(run_dir / "learners" / "1" / "checkpoint") is None  # it left the checkpoint alone
    rejections = syncer_status(run_dir)["rejections"]
    assert rejections.get("another_process", 0) >= 1, rejections
    rounds = syncer_status(run_dir)["rounds_committed"]
    wait_until(lambda: syncer_status(run_dir)["rounds_committed"] >= rounds + 4, "rounds with the replacement",
               alive=[syncer, replacement])
    assert syncer_status(run_dir).get("alive_learners") == [0, 1]
    for name, learner in (("learner 0", learners[0]), ("the replacement", replacement)):
        stop(learner, name)
    assert load_latest_state(run_dir / "learners" / "1" / "checkpoint") is not None  # the replacement's, at its end
    stop(syncer, "the syncer")
    assert_state_equals_replay(run_dir, assert_log_is_gapless(run_dir))


def test_a_restarted_syncer_refuses_a_round_damaged_on_disk_and_names_it(tmp_path, procs):
    # Issue 13 item 8. Before: the flipped round replayed silently into another global state.
    run_dir = tmp_path / "run"
    syncer, address = start_syncer(procs, run_dir, "--full-state-every", "1000000")  # replay every round
    learners = [start_learner(procs, run_dir, address, i) for i in range(2)]
    wait_until(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= 3, "3 rounds", alive=[syncer, *learners])
    for popen in (syncer, *learners):
        os.kill(popen.pid, signal.SIGKILL)
        popen.wait()
    last = len(RoundLog(run_dir).lines()) - 1
    _, _, state_rounds = load_latest_state(run_dir / "checkpoints" / "syncer")
    assert state_rounds <= last  # the restart replays the damaged round
    flip_bit_in_tensor_data(RoundLog(run_dir).tensors_path(last))

    restarted = procs.start("syncer-restarted", "syncer", "--run-dir", str(run_dir), *RUN_FLAGS, "--bind", address)
    serving = lambda: (read_json(run_dir / "syncer.json") or {}).get("pid") == restarted.pid  # noqa: E731
    wait_until(lambda: restarted.poll() is not None or serving(), "the restarted syncer to exit or serve")
    assert not serving() and restarted.wait() == 2  # EXIT_USAGE: one message, no traceback
    log = procs.log("syncer-restarted")
    assert f"round {last} is damaged" in log and f"round_{last:06d}.safetensors" in log and "backup" in log
    assert "Traceback" not in log


def test_watch_sends_the_model_at_once_then_at_most_every_min_interval():
    """The Watch call (an evaluator's read-only subscription) asks the service for a snapshot not before
    the previous one plus min_interval_s, and only after newer rounds (real gRPC on 127.0.0.1)."""
    import time

    from ddiloco.config import DilocoConfig
    from ddiloco.fragments import FragmentPlan
    from ddiloco.messages import FragmentState, ModelSpec, Welcome
    from ddiloco.transport.grpc_client import SyncerClient
    from ddiloco.transport.grpc_codec import WireModel
    from ddiloco.transport.grpc_server import start_server
    from ddiloco.transport.syncer_handler import STOPPED
    from tests.helpers import TinyNet, params_of

    config = DilocoConfig(num_fragments=2, codec="fp32")
    params = params_of(TinyNet())
    plan = FragmentPlan.for_tensors(params, config)
    welcome = Welcome(0, tuple(FragmentState(p, 1, {n: params[n] for n in names})
                               for p, names in enumerate(plan.fragments)), config.fingerprint())
    calls: list[tuple[int, float, float]] = []

    class Handler:
        def snapshot(self, after_round, not_before):
            calls.append((after_round, not_before, time.monotonic()))
            return (after_round + 2, welcome) if len(calls) <= 3 else STOPPED  # the service's rule is not tested here

    server, port = start_server(Handler(), "127.0.0.1:0", token=None)
    client = SyncerClient(f"127.0.0.1:{port}", model=WireModel(ModelSpec.from_named_tensors(params.items()), plan,
                                                                  "fp32"), diloco_config=config)
    try:
        received = list(client.watch(min_interval_s=30.0))
    finally:
        client.close()
        server.stop(0)
    assert len(received) == 3 and all(isinstance(w, Welcome) for w in received)
    assert [after for after, _, _ in calls] == [-1, 1, 3, 5]
    assert calls[0][1] <= time.monotonic()  # the first snapshot: at once
    for (_, not_before, _), (_, _, previous_at) in zip(calls[1:], calls, strict=False):
        assert not_before >= previous_at + 30.0


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs: a real file system that fills up (ENOSPC from the kernel). Needs root, as CI has."""
    import subprocess

    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the full-disk test needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory) -> int:
    """Write a file in `directory` until the disk is full; its size."""
    chunk, size = b"\0" * (1 << 20), 0
    with open(directory / "filler", "wb", buffering=0) as file:
        while True:
            try:
                size += file.write(chunk)
            except OSError:
                break
        for small in (1 << 14, 1 << 10, 1):  # down to the last byte
            while True:
                try:
                    size += file.write(chunk[:small])
                except OSError:
                    break
    return size


def test_a_full_disk_pauses_commits_and_loses_nothing_and_the_run_goes_on_when_space_is_back(small_disk, procs):
    # Issue 13 item 3. Before: versions advanced before the round log's write failed, pushes failed with
    # UNKNOWN: [Errno 28], the log then read rounds 0-4 then 9-13 and the restarted syncer refused to start.
    run_dir = small_disk / "run"
    syncer, address = start_syncer(procs, run_dir)
    learners = [start_learner(procs, run_dir, address, i) for i in range(2)]
    wait_until(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= 10, "10 rounds", alive=[syncer, *learners])

    fill(small_disk)
    wait_until(lambda: procs.log("syncer").count("refusing updates") >= 3, "three rounds refused for a full disk",
               alive=[syncer, *learners])
    assert "unavailable" in procs.log("learner0") + procs.log("learner1")  # told why, and training on
    during = len(RoundLog(run_dir).lines())

    (small_disk / "filler").unlink()
    wait_until(lambda: "rounds are durable again" in procs.log("syncer"), "the syncer writing again",
               alive=[syncer, *learners])
    wait_until(lambda: syncer_status(run_dir).get("rounds_committed", 0) >= during + 10, "10 rounds after",
               alive=[syncer, *learners])
    assert syncer_status(run_dir)["storage_error"] is None
    for i, learner in enumerate(learners):
        stop(learner, f"learner {i}")
    stop(syncer, "the syncer")

    records = assert_log_is_gapless(run_dir)
    assert_state_equals_replay(run_dir, records)
    for path in run_dir.rglob("*.jsonl"):  # no torn line anywhere: every line parses
        for line in path.read_text().splitlines():
            json.loads(line)
    restarted, _ = start_syncer(procs, run_dir, name="syncer-restarted")
    wait_until(lambda: f"resumed at round {len(records)}" in procs.log("syncer-restarted"), "the restart",
               alive=[restarted])
    stop(restarted, "the restarted syncer")



def test_refused_calls_are_logged_once_per_period_and_peer_and_counted_exactly(tmp_path, caplog):
    """1000 unauthenticated calls against a syncer service behind real gRPC on 127.0.0.1: one log line and one
    event in full, one summary of the other 999 when the period ends (here: at the stop), the count exact. An
    update's rejection is its fate, so those are recorded one by one."""
    import logging

    import grpc

    from ddiloco.config import DilocoConfig
    from ddiloco.data import DataConfig
    from ddiloco.messages import SCHEMA_VERSION
    from ddiloco.metrics import MemorySink
    from ddiloco.model import ModelConfig
    from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
    from ddiloco.runtime.syncer_state import SyncerStore
    from ddiloco.syncer import Syncer
    from ddiloco.transport import wire_pb2, wire_pb2_grpc
    from ddiloco.transport.grpc_common import SCHEMA_KEY, TOKEN_KEY
    from ddiloco.transport.grpc_server import start_server

    run = RunConfig(model=ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32),
                    data=DataConfig(context_len=32, batch_size=4), diloco=DilocoConfig(num_fragments=2),
                    num_learners=1)
    sink = MemorySink()
    service = SyncerService(run, Syncer(run.diloco, run.quorum, initial_params=initial_params(run)),
                            SyncerStore(tmp_path), sink=sink, config=SyncerServiceConfig(refusal_log_period_s=3600.0))
    server, port = start_server(service, "127.0.0.1:0", token="the-run-token")
    service.start(f"127.0.0.1:{port}")
    caplog.set_level(logging.INFO, logger="ddiloco.runtime.syncer_service")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = wire_pb2_grpc.SyncerStub(channel)
        wrong = ((TOKEN_KEY, "not-the-token"), (SCHEMA_KEY, str(SCHEMA_VERSION)))
        for _ in range(1000):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=0), metadata=wrong, timeout=PROCESS_WAIT_S)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for inner_step in range(1, 51):
            service.record_rejection("corrupt", "CRC32 differs", learner_id=0, peer="ipv4:127.0.0.1:1",
                                     fragment=0, inner_step=inner_step)
        assert service.status()["rejections"] == {"unauthenticated": 1000, "corrupt": 50}
        logged = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
        assert len(logged) == 1 and "wrong run token" in logged[0]
        assert len([e for e in sink.events if e["kind"] == "rejection" and e["reason"] == "unauthenticated"]) == 1
        corrupt = [e["inner_step"] for e in sink.events if e["kind"] == "rejection" and e["reason"] == "corrupt"]
        assert corrupt == list(range(1, 51))
    finally:
        channel.close()
        service.close(server)
    (summary,) = [e for e in sink.events if e["kind"] == "rejections_suppressed"]
    assert (summary["reason"], summary["peer"], summary["count"]) == ("unauthenticated", "ipv4:127.0.0.1", 999)
    assert len([r for r in caplog.records if "unauthenticated" in r.getMessage()]) == 2
