"""Injected faults in the learner's transport, without processes: the CRC32 that catches corrupted
bytes, the link arithmetic of latency and bandwidth faults, the client's partition and drop, the
learner's work ledger, and what the syncer core keeps for the chaos accounting.

Faults come from a real `ChaosControl` reading a real control file, on a clock the test moves.
"""

import json
import threading
import zlib

import grpc
import pytest
import torch

from ddiloco.clock import VirtualClock
from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.fault_control import ActiveFault, ChaosControl, control_path, write_control
from ddiloco.fragments import FragmentPlan
from ddiloco.learner import Learner
from ddiloco.messages import Commit, FragmentState, ModelSpec, RejectReason, Update, Welcome
from ddiloco.round_log import round_record_from_json
from ddiloco.syncer import HeldUpdate
from ddiloco.transport.grpc_client import PARTITIONED, ChaosFault, Fault, SyncerClient, classify, drop_reason
from ddiloco.transport.grpc_codec import (
    UpdateAssembler,
    WireError,
    WireModel,
    encode_update,
    flip_data_byte,
)
from ddiloco.transport.link import NO_FAULTS, EmulatedLink, LinkConfig, parse_link, unlimited_link
from ddiloco.transport.syncer_stream import SyncerStreamDecoder, encode_syncer_message
from ddiloco.work_ledger import WorkLedger, fragment_shares
from tests.helpers import TinyNet, make_system, params_of, train_step

CONFIG = DilocoConfig(num_fragments=2, sync_every=4, codec="int4")
SMALL_CHUNK = 64
NOW = 1_000_000.0
"""The wall time the control file's `until`s are measured against (the test's fake clock)."""


@pytest.fixture
def params():
    return params_of(TinyNet(seed=3))


@pytest.fixture
def model(params):
    return WireModel(ModelSpec.from_named_tensors(params.items()), FragmentPlan.for_tensors(params, CONFIG), "int4")


def _update(model, params, fragment=0):
    codec = get_codec("int4")
    payload = {n: codec.encode(0.01 * params[n]) for n in model.plan.fragments[fragment]}
    return Update(1, fragment, 2, inner_step=10, steps=4, tokens=96, codec="int4", payload=payload)


def _state(model, params, fragment, version):
    return FragmentState(fragment, version, {n: params[n] for n in model.plan.fragments[fragment]})


def _control(tmp_path, *faults: ActiveFault) -> ChaosControl:
    path = control_path(tmp_path)
    write_control(path, faults)
    return ChaosControl(path, clock=lambda: NOW, refresh_s=0.0, seed=0)


# ---- CRC32 ------------------------------------------------------------------------------------------

def test_every_encoder_stamps_the_crc32_of_its_tensor_bytes(model, params):
    update = _update(model, params)
    (header_chunk, *_) = encode_update(update, model.spec)
    payload = b"".join(update.payload[t.name] for t in header_chunk.header.tensors)
    assert header_chunk.header.crc32 == zlib.crc32(payload)
    state = _state(model, params, 1, 7)
    (first, *_) = encode_syncer_message(state)
    raw = b"".join(state.tensors[t.name].numpy().tobytes() for t in first.fragment_state.tensors)
    assert first.fragment_state.crc32 == zlib.crc32(raw)


def test_a_corrupted_update_byte_is_refused_as_corrupt_with_its_header_intact(model, params):
    chunks = list(encode_update(_update(model, params), model.spec, chunk_bytes=SMALL_CHUNK))
    header_before = chunks[0].header.SerializeToString()
    assert flip_data_byte(chunks[1])
    assert chunks[0].header.SerializeToString() == header_before
    assembler = UpdateAssembler(model)
    assembler.start(chunks[0])  # the header still passes every check
    for chunk in chunks[1:]:
        assembler.add(chunk)
    with pytest.raises(WireError, match="CRC32") as caught:
        assembler.finish()
    assert caught.value.reason == str(RejectReason.CORRUPT) == "corrupt"
    assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("which", ["fragment_state", "welcome"])
def test_a_corrupted_downlink_byte_is_refused_by_the_decoder(model, params, which):
    state = _state(model, params, 1, 7)
    message = state if which == "fragment_state" else Welcome(4, (_state(model, params, 0, 3), state), "f")
    clean = list(encode_syncer_message(message, chunk_bytes=SMALL_CHUNK))
    (back,) = [m for m in map(SyncerStreamDecoder(model).feed, clean) if m is not None]
    assert type(back) is type(message)
    corrupted = list(encode_syncer_message(message, chunk_bytes=SMALL_CHUNK))
    flip_data_byte(corrupted[-1])  # the last fragment's bytes, so a Welcome's per-fragment check is hit
    decoder = SyncerStreamDecoder(model)
    with pytest.raises(WireError, match="CRC32") as caught:
        for chunk in corrupted:
            decoder.feed(chunk)
    assert caught.value.reason == "corrupt"


def test_flip_leaves_a_chunk_without_data_alone(model, params):
    (only,) = encode_syncer_message(_state(model, params, 0, 1), chunk_bytes=1 << 20)
    only.ClearField("data")
    assert not flip_data_byte(only)


# ---- link arithmetic under latency and bandwidth faults --------------------------------------------------

def test_a_latency_fault_adds_to_the_one_way_delay_in_both_directions(tmp_path):
    clock = VirtualClock(10.0)
    faults = _control(tmp_path, ActiveFault("latency", NOW + 5, 0.25))
    link = EmulatedLink(parse_link("8mbit,40ms"), clock=clock, faults=faults)
    assert link.send_at(1000) == pytest.approx(10.0 + 0.04 + 0.25)  # within the burst: no serialisation
    assert link.receive_at(1000, arrived_at=11.0) == pytest.approx(11.0 + 0.04 + 0.25)


def test_a_bandwidth_cap_serialises_each_direction_at_the_capped_rate(tmp_path):
    clock = VirtualClock(0.0)
    path = control_path(tmp_path)
    wall = [NOW]
    faults = ChaosControl(path, clock=lambda: wall[0], refresh_s=0.0)
    write_control(path, [ActiveFault("bandwidth", NOW + 5, 1000.0)])
    link = unlimited_link(clock, faults=faults)
    # 500 bytes at 1000 B/s: 0.5 s each, one after the other on the uplink ...
    assert link.send_at(500) == pytest.approx(0.5)
    assert link.send_at(500) == pytest.approx(1.0)
    clock.advance_to(3.0)
    assert link.send_at(250) == pytest.approx(3.25)  # the link was idle again: no queue
    # ... while the downlink has its own queue.
    assert link.receive_at(500, arrived_at=0.0) == pytest.approx(0.5)
    wall[0] = NOW + 6  # the fault is over: unshaped again
    clock.advance_to(3.1)
    assert link.send_at(10**6) == pytest.approx(3.1)


def test_a_bandwidth_cap_below_the_emulated_link_dominates_it(tmp_path):
    clock = VirtualClock(0.0)
    faults = _control(tmp_path, ActiveFault("bandwidth", NOW + 5, 1000.0))
    link = EmulatedLink(LinkConfig(bandwidth_bps=8e6, latency_s=0.01), clock=clock, faults=faults)
    # The 1 MB/s link would take (100 kB - burst) / 1 MB/s; the 1 kB/s cap takes 100 s.
    assert link.send_at(100_000) == pytest.approx(100.0 + 0.01)


# ---- the client: partitions and drops --------------------------------------------------------------------

def _client(model, faults) -> SyncerClient:
    # Nothing listens on port 9: any call that reached the network would fail with another message.
    return SyncerClient("127.0.0.1:9", model=model, diloco_config=CONFIG, link=unlimited_link(faults=faults))


def test_a_partition_fails_every_call_at_once_as_a_transient_fault(tmp_path, model, params):
    client = _client(model, _control(tmp_path, ActiveFault("partition", NOW + 5)))
    learner = Learner(CONFIG, learner_id=0, model=TinyNet())
    calls = {"push": lambda: client.push(client.encode_update(_update(model, params))),
             "heartbeat": lambda: client.heartbeat(0, 5), "leave": lambda: client.leave(0),
             "subscribe": lambda: next(client.subscribe(learner.join_message()))}
    try:
        for name, call in calls.items():
            with pytest.raises(ChaosFault) as caught:
                call()
            error = caught.value
            assert isinstance(error, grpc.RpcError), name
            assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == PARTITIONED
            assert classify(error) is Fault.TRANSIENT and drop_reason(error) == "partition"
        assert client.bytes_sent == 0
    finally:
        client.close()


def test_a_drop_loses_updates_and_heartbeats_before_they_are_sent(tmp_path, model, params):
    client = _client(model, _control(tmp_path, ActiveFault("drop", NOW + 5, 1.0)))
    try:
        with pytest.raises(ChaosFault, match="update was dropped") as caught:
            client.push(client.encode_update(_update(model, params)))
        assert drop_reason(caught.value) == "drop"
        with pytest.raises(ChaosFault, match="heartbeat was dropped"):
            client.heartbeat(0, 5)
        assert client.bytes_sent == 0
    finally:
        client.close()


def test_a_real_transport_error_is_dropped_as_unreachable(model):
    client = _client(model, NO_FAULTS)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            client.heartbeat(0, 1, timeout_s=2.0)
        assert drop_reason(caught.value) == "unreachable" and classify(caught.value) is Fault.TRANSIENT
    finally:
        client.close()


# ---- the work ledger ----------------------------------------------------------------------------------

def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_ledger_counts_unpublished_steps_from_the_later_of_publish_and_receive(tmp_path, model, params):
    times = iter(range(100, 200))
    path = tmp_path / "learners" / "0" / "work.jsonl"
    ledger = WorkLedger(path, num_fragments=2, inner_step=10, wall_clock=lambda: float(next(times)))
    ledger.start(inner_step=10, shares=[0.25, 0.75])
    ledger.welcome(Welcome(0, (_state(model, params, 1, 4), _state(model, params, 0, 3)), "f"), inner_step=10,
                   replaced=[0, 1])
    first = Update(0, 0, 3, inner_step=14, steps=4, tokens=40, codec="int4", payload={})
    ledger.publish(first)
    ledger.fate(first, "dropped", "partition")
    # Published again from the same base (its round never came): `steps` counts both, `new_steps` only
    # the steps since the first publish.
    second = Update(0, 0, 3, inner_step=18, steps=8, tokens=80, codec="int4", payload={})
    ledger.publish(second)
    ledger.received(_state(model, params, 1, 5), inner_step=19)
    ledger.fate(second, "accepted", "")
    # A re-join: fragment 1 was replaced (it counts its unpublished steps); fragment 0 was still at the
    # learner's version, so its work was kept and counts on.
    ledger.welcome(Welcome(0, (_state(model, params, 0, 3), _state(model, params, 1, 6)), "f"), inner_step=21,
                   replaced=[1])
    ledger.end("stopped", inner_step=22)
    lines = _lines(path)  # before close: every line is already flushed
    ledger.close()
    assert [line.pop("time") for line in lines] == list(range(100, 100 + len(lines)))
    assert lines[0].pop("pid") > 0
    assert lines == [
        {"event": "start", "inner_step": 10, "shares": [0.25, 0.75]},
        {"event": "welcome", "inner_step": 10, "versions": [3, 4], "unpublished": [0, 0]},
        {"event": "publish", "fragment": 0, "base_version": 3, "inner_step": 14, "steps": 4, "new_steps": 4,
         "tokens": 40},
        {"event": "fate", "fragment": 0, "base_version": 3, "inner_step": 14, "fate": "dropped",
         "reason": "partition"},
        {"event": "publish", "fragment": 0, "base_version": 3, "inner_step": 18, "steps": 8, "new_steps": 4,
         "tokens": 80},
        {"event": "received", "fragment": 1, "version": 5, "inner_step": 19, "unpublished": 9},
        {"event": "fate", "fragment": 0, "base_version": 3, "inner_step": 18, "fate": "accepted", "reason": ""},
        {"event": "welcome", "inner_step": 21, "versions": [3, 6], "unpublished": [0, 2]},
        {"event": "end", "inner_step": 22, "state": "stopped", "unpublished": [4, 1]},
    ]
    ledger.write("fate", late=True)  # a thread that outlived close writes nothing, and does not crash
    assert len(_lines(path)) == len(lines)


def test_the_ledger_appends_across_incarnations_and_keeps_lines_whole_under_threads(tmp_path):
    path = tmp_path / "work.jsonl"
    WorkLedger(path, num_fragments=1, inner_step=0).close()
    ledger = WorkLedger(path, num_fragments=1, inner_step=0)
    ledger.start(inner_step=0, shares=[1.0])
    update = Update(0, 0, 0, inner_step=1, steps=1, tokens=1, codec="int4", payload={})
    writers = [threading.Thread(target=lambda: [ledger.fate(update, "accepted", "") for _ in range(200)])
               for _ in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    ledger.close()
    ledger = WorkLedger(path, num_fragments=1, inner_step=0)
    ledger.start(inner_step=0, shares=[1.0])
    ledger.close()
    events = [line["event"] for line in _lines(path)]
    assert events == ["start"] + ["fate"] * 800 + ["start"]


def test_fragment_shares_are_parameter_fractions_that_sum_to_one():
    learner = Learner(CONFIG, learner_id=0, model=TinyNet())
    shares = fragment_shares(learner)
    numel = {n: p.numel() for n, p in learner.model.named_parameters()}
    assert shares[0] == pytest.approx(sum(numel[n] for n in learner.plan.fragments[0]) / sum(numel.values()))
    assert sum(shares) == pytest.approx(1.0)


# ---- the syncer core: inner steps in rounds, held updates ----------------------------------------------

def test_participants_carry_the_inner_step_and_open_rounds_can_be_listed():
    syncer, _, clock, learners = make_system(2, CONFIG, QuorumConfig(min_quorum=2, grace="none"))
    learner, optimizer = learners[0], torch.optim.SGD(learners[0].model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    updates = []
    for _ in range(2):  # the first fragment falls due at inner step 2
        tokens = train_step(learner.model, optimizer, torch.randint(0, 16, (4, 7), generator=generator))
        updates += learner.after_inner_step(tokens)
    (update,) = updates
    syncer.receive(update, clock.now())
    assert syncer.held_updates() == [HeldUpdate(0, update.fragment, update.base_version, update.inner_step)]
    other = Update(1, update.fragment, update.base_version, inner_step=7, steps=2, tokens=update.tokens,
                   codec=update.codec, payload=update.payload)
    (record,) = [a.record for a in syncer.receive(other, clock.now()) if isinstance(a, Commit)]
    assert [(p.learner_id, p.inner_step) for p in record.participants] == [(0, update.inner_step), (1, 7)]
    assert syncer.held_updates() == []
    line = json.loads(json.dumps(record.to_json()))
    assert round_record_from_json(line, dict(record.merged)).participants == record.participants
    for participant in line["participants"]:  # a round log written before inner_step was recorded
        del participant["inner_step"]
    assert [p.inner_step for p in round_record_from_json(line, dict(record.merged)).participants] == [-1, -1]
