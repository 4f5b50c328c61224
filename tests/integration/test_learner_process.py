"""`ddiloco learner` as a real process: kill -9 and restart from its checkpoint, refusals; and the
learner's transport: link emulation and TLS.

Real processes, real gRPC on 127.0.0.1 with an ephemeral port, real signals; every wait has a hard
deadline and the fixture kills every process it started, by PID. The link-emulation and TLS tests run
the syncer service in this process (still real gRPC over loopback) to time deliveries precisely.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

import grpc
import pytest
import torch

from ddiloco.checkpoint import load_latest_state, read_json
from ddiloco.data import DataConfig
from ddiloco.learner import Learner
from ddiloco.messages import Welcome
from ddiloco.metrics import NullSink
from ddiloco.model import ModelConfig, build_model
from ddiloco.round_log import RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer
from ddiloco.train_tinygpt import initial_params
from ddiloco.transport.grpc_client import SyncerClient
from ddiloco.transport.grpc_codec import WireModel
from ddiloco.transport.grpc_server import start_server
from ddiloco.transport.learner_io import LearnerIO
from ddiloco.transport.link import EmulatedLink, parse_link
from tests.helpers import PROCESS_WAIT_S, TINY_MODEL_FLAGS, TINY_RUN, wait_until

pytestmark = pytest.mark.integration

TOKEN = "learner-process-test-token-0123"
RUN_FLAGS = (*TINY_MODEL_FLAGS, "--learners", "2", "--inner-steps", "100000000", "--num-fragments", "2",
             "--sync-every", "8", "--max-wait-s", "0.5", "--heartbeat-timeout-s", "3", "--heartbeat-every-s", "0.5")



@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    os.chmod(path, 0o600)
    return path


def start_syncer(procs, run_dir, token_file, *extra):
    popen = procs.start("syncer", "syncer", "--run-dir", str(run_dir), *RUN_FLAGS,
                        "--token-file", str(token_file), *extra)
    info = wait_until(lambda: read_json(run_dir / "syncer.json"), "syncer.json", alive=[popen])
    return popen, info["address"]


def start_learner(procs, run_dir, address, learner_id, *extra, name=None):
    return procs.start(name or f"learner{learner_id}", "learner", "--syncer", address, "--learner-id", str(learner_id),
                       "--run-dir", str(run_dir), "--threads", "1", *extra)


def learner_status(run_dir, learner_id) -> dict:
    return read_json(run_dir / "learners" / str(learner_id) / "status.json") or {}


def accepted(run_dir, learner_id) -> int:
    status = read_json(run_dir / "syncer_status.json") or {}
    return status.get("learners", {}).get(str(learner_id), {}).get("accepted", 0)


def participations(run_dir, learner_id) -> int:
    """Committed rounds that merged an update of this learner (from the durable round log)."""
    return sum(learner_id in [p["learner_id"] for p in line["participants"]] for line in RoundLog(run_dir).lines())


def test_a_killed_learner_restarts_from_its_checkpoint_and_contributes_again(tmp_path, procs, token_file):
    run_dir = tmp_path / "run"
    syncer, address = start_syncer(procs, run_dir, token_file)
    common = ("--token-file", str(token_file), "--checkpoint-every-s", "0.2", "--status-every-s", "0.1")
    learners = [start_learner(procs, run_dir, address, 0, *common),
                start_learner(procs, run_dir, address, 1, *common, "--link", "200mbit,5ms")]
    checkpoint_dir = run_dir / "learners" / "0" / "checkpoint"
    wait_until(lambda: (s := load_latest_state(checkpoint_dir)) and s[2] >= 40 and participations(run_dir, 0) >= 3,
               "learner 0 checkpointed and contributing", alive=[syncer, *learners])

    os.kill(learners[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    learners[0].wait()
    _, _, checkpoint_step = load_latest_state(checkpoint_dir)
    # The new process starts its counters from the killed one's last status.json (written after its last
    # checkpoint): only more than that, with a second join, is an update of the new process.
    accepted_at_kill = learner_status(run_dir, 0)["updates_accepted"]
    merged_at_kill, rounds_at_kill = participations(run_dir, 0), len(RoundLog(run_dir).lines())
    restarted = start_learner(procs, run_dir, address, 0, *common, name="learner0-restarted")
    status = wait_until(lambda: (s := learner_status(run_dir, 0)).get("pid") == restarted.pid
                        and s["joins"] >= 2 and s["updates_accepted"] > accepted_at_kill and s,
                        "an accepted update of the restarted learner", alive=[syncer, restarted, learners[1]])
    print(f"learner recovery: kill -9 -> next accepted update in {time.monotonic() - killed_at:.1f} s "
          "(restarted at once, by hand)")
    assert status["inner_step"] >= checkpoint_step
    assert f"[learner 0 | inner {checkpoint_step}] resumed from its checkpoint" in procs.log("learner0-restarted")
    # Its updates are merged again: the old process had at most one pending per fragment (2).
    wait_until(lambda: participations(run_dir, 0) >= merged_at_kill + 3, "the restarted learner merged",
               alive=[syncer, restarted, learners[1]])
    # The other learner never stopped: rounds went on while learner 0 was down.
    assert len(RoundLog(run_dir).lines()) > rounds_at_kill
    for popen in (restarted, learners[1], syncer):
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(timeout=PROCESS_WAIT_S) == 0
    linked = learner_status(run_dir, 1)
    assert linked["bytes_sent"] > 0 and linked["bytes_received"] > 0


def test_refused_learners_exit_3_naming_the_mismatch_and_bad_flags_exit_2(tmp_path, procs, token_file):
    from safetensors.torch import save_file

    run_dir = tmp_path / "run"
    # The run's model is fixed by its genesis: here an --init file (else the first learner to join).
    init = tmp_path / "init.safetensors"
    tiny = ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32)
    save_file(initial_params(RunConfig(model=tiny, data=DataConfig(context_len=32))), str(init))
    syncer, address = start_syncer(procs, run_dir, token_file, "--init", str(init))
    wrong_token = tmp_path / "wrong-token"
    wrong_token.write_text("not-the-run-token-at-all-0123")
    os.chmod(wrong_token, 0o600)
    # Learners on other machines: a run directory of their own and a copy of the run's config, changed by their
    # flags (one that shares DIR/config.json is refused before it connects: test_standalone_processes.py).
    own_config = ("--config", str(run_dir / "config.json"))
    cases = {
        "token": (run_dir, ("--token-file", str(wrong_token)), "wrong run token"),
        "config": (tmp_path / "b", ("--token-file", str(token_file), *own_config, "--outer-lr", "0.5"),
                   "--outer-lr 0.5 (the run has 0.7)"),
        # The settings it declares, before its model could differ from the genesis (the first to join, else).
        "model": (tmp_path / "c", ("--token-file", str(token_file), *own_config, "--model-width", "64"),
                  "this learner's settings differ from the run's: --model-width 64 (the run has 32)"),
    }
    started = {name: start_learner(procs, directory, address, 0, *flags, name=name)
               for name, (directory, flags, _) in cases.items()}
    bad_link = start_learner(procs, run_dir, address, 0, "--link", "fast", name="bad-link")
    for name, (_, _, needle) in cases.items():
        assert started[name].wait(timeout=PROCESS_WAIT_S) == 3, procs.log(name)
        # Said once in the log and once in the exit line (the transport, the rules and the session each logged it).
        assert procs.log(name).count("refused by the syncer") == 2 and needle in procs.log(name), procs.log(name)
    assert bad_link.wait(timeout=PROCESS_WAIT_S) == 2 and "BANDWIDTH,LATENCY" in procs.log("bad-link")
    assert syncer.poll() is None  # and the syncer serves on, having counted each refusal
    wait_until(lambda: (r := (read_json(run_dir / "syncer_status.json") or {}).get("rejections", {}))
               and r.get("refused", 0) >= 2 and r.get("unauthenticated", 0) >= 1, "refusals counted", alive=[syncer])


@contextlib.contextmanager
def serving(tmp_path, *, tls=None):
    """A syncer service in this process behind a real gRPC server on 127.0.0.1; yields (syncer, port)."""
    syncer = Syncer(TINY_RUN.diloco, TINY_RUN.quorum, initial_params=initial_params(TINY_RUN))
    service = SyncerService(TINY_RUN, syncer, SyncerStore(tmp_path), sink=NullSink(),
                            config=SyncerServiceConfig())
    server, port = start_server(service, "127.0.0.1:0", token=None,
                                tls=tls)
    service.start(f"127.0.0.1:{port}")
    try:
        yield syncer, port
    finally:
        service.close(server)


def tiny_learner() -> Learner:
    return Learner(TINY_RUN.diloco, learner_id=0, model=build_model(TINY_RUN.model))


def first_message(io: LearnerIO):
    deadline = time.monotonic() + PROCESS_WAIT_S
    while time.monotonic() < deadline:
        io.inbox.wait(timeout_s=1.0)
        messages = io.inbox.take_ready()
        if messages:
            return messages[0]
    pytest.fail("no message from the syncer")


def test_link_emulation_holds_messages_for_their_transfer_time(tmp_path):
    """A Welcome over an emulated 8 Mbit/s, 150 ms link reaches the learner's inbox only after
    latency + size / bandwidth, while the bytes themselves arrived over loopback at once."""
    with serving(tmp_path) as (syncer, port):
        learner = tiny_learner()
        link = EmulatedLink(parse_link("8mbit,150ms"))
        client = SyncerClient(f"127.0.0.1:{port}", model=WireModel(learner.spec, learner.plan, "int4"),
                              diloco_config=TINY_RUN.diloco, link=link)
        io = LearnerIO(client, learner.join_message(), heartbeat_every_s=1.0)
        try:
            started = time.monotonic()
            io.start()
            wait_until(lambda: client.bytes_received > 0, "the Welcome's bytes")
            assert io.inbox.take_ready() == []  # on the socket already, but still "in flight" on the link
            welcome = first_message(io)
            elapsed = time.monotonic() - started
            assert isinstance(welcome, Welcome)
            burst = link.downlink.bucket.burst_bytes
            assert elapsed >= 0.15 + (client.bytes_received - burst) * 8 / 8e6 - 0.01
            learner.receive(welcome)
            assert all(torch.equal(p, syncer.global_params()[n]) for n, p in learner.model.named_parameters())
            assert client.bytes_sent > 0
        finally:
            io.close(leave=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_serves_verified_learners_and_refuses_plaintext(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    with serving(tmp_path, tls=(key.read_bytes(), cert.read_bytes())) as (_, port):
        learner = tiny_learner()
        wire = WireModel(learner.spec, learner.plan, "int4")
        secure = SyncerClient(f"127.0.0.1:{port}", model=wire, diloco_config=TINY_RUN.diloco,
                              tls_root_certificates=cert.read_bytes())
        io = LearnerIO(secure, learner.join_message(), heartbeat_every_s=1.0)
        io.start()
        try:
            assert isinstance(first_message(io), Welcome)
        finally:
            io.close(leave=True)
        plain = SyncerClient(f"127.0.0.1:{port}", model=wire, diloco_config=TINY_RUN.diloco)
        with pytest.raises(grpc.RpcError) as caught:
            plain.status(timeout_s=5.0)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        plain.close()


def test_a_learner_given_several_syncer_addresses_moves_to_the_next_when_one_is_unreachable(tmp_path):
    # Issue 13 item 11: a syncer and its standby on another host; learners are given both addresses.
    import socket

    with socket.socket() as probe:  # a port nobody listens on: the "dead primary"
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    with serving(tmp_path) as (syncer, port):
        learner = tiny_learner()
        client = SyncerClient(f"127.0.0.1:{dead},127.0.0.1:{port}", model=WireModel(learner.spec, learner.plan, "int4"),
                              diloco_config=TINY_RUN.diloco)
        io = LearnerIO(client, learner.join_message(), heartbeat_every_s=1.0)
        try:
            io.start()
            assert isinstance(first_message(io), Welcome)
            assert client.address == f"127.0.0.1:{port}"
        finally:
            io.close(leave=False)
