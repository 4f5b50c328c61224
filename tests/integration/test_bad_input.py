"""Bad input against a real `ddiloco syncer`: hand-built protobuf messages over raw gRPC.

One syncer process serves the whole module. A well-behaved raw client joins as learner 0 and gets a
round committed, so the syncer holds a non-trivial state; then every kind of bad input is thrown at
it. Each must be refused with a status and a message naming the problem, be counted in the syncer's
rejections under its reason, and leave the syncer's state (versions, rounds, live learners)
unchanged; at the end the syncer still serves the good client.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import threading
from dataclasses import dataclass

import grpc
import pytest
import torch

from ddiloco.checkpoint import read_json
from ddiloco.compression import get_codec
from ddiloco.data import DataConfig
from ddiloco.learner import Learner
from ddiloco.messages import SCHEMA_VERSION, FragmentDelta, FragmentState, Update, Welcome
from ddiloco.model import build_model
from ddiloco.run_config import RunConfig
from ddiloco.transport import wire_pb2, wire_pb2_grpc
from ddiloco.transport.auth import learner_token
from ddiloco.transport.grpc_codec import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    WireModel,
    encode_join,
    encode_update,
)
from ddiloco.transport.grpc_common import SCHEMA_KEY, SESSION_KEY, TOKEN_KEY
from ddiloco.transport.syncer_stream import SyncerStreamDecoder
from tests.helpers import PROCESS_WAIT_S, TINY_MODEL_FLAGS, Processes, wait_until

pytestmark = pytest.mark.integration

TOKEN = "bad-input-test-token-0123456789"
CALL_TIMEOUT_S = 30.0
FLOOD_CALLS = 1000
FLOOD_LINES = 6
"""At most this many log lines (or events) for FLOOD_CALLS refused calls: a few periods of one line and one summary."""


@dataclass
class Syncer:
    run_dir: object
    stub: wire_pb2_grpc.SyncerStub
    config: RunConfig
    learner: Learner
    wire: WireModel
    inbox: queue.Queue
    procs: Processes


def metadata(token: str | None = TOKEN, schema: str | None = str(SCHEMA_VERSION), *, learner: int | None = 0,
             session: str | None = None):
    """Call metadata; with the run's token, the token of `learner` (the learner a call acts for)."""
    if token == TOKEN and learner is not None:
        token = learner_token(TOKEN, learner)
    pairs = ((TOKEN_KEY, token), (SCHEMA_KEY, schema), (SESSION_KEY, session))
    return tuple((k, v) for k, v in pairs if v is not None)


def follow(stream, wire: WireModel, inbox: queue.Queue) -> None:
    decoder = SyncerStreamDecoder(wire)
    try:
        for chunk in stream:
            message = decoder.feed(chunk)
            if message is not None:
                inbox.put(message)
    except grpc.RpcError:
        pass  # the stream ends with the module


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_input")
    run_dir = base / "run"
    token_file = base / "token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    procs = Processes(base / "logs")
    channel = None
    try:
        from safetensors.torch import save_file

        from ddiloco.model import ModelConfig
        from ddiloco.train_tinygpt import initial_params

        init = base / "init.safetensors"  # the genesis, from the first join: the wire checks know the model
        tiny = ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32)
        save_file(initial_params(RunConfig(model=tiny, data=DataConfig(context_len=32))), str(init))
        popen = procs.start("syncer", "syncer", "--run-dir", str(run_dir), *TINY_MODEL_FLAGS, "--learners", "2",
                            "--num-fragments", "2", "--grace", "none", "--token-file", str(token_file),
                            "--init", str(init))
        info = wait_until(lambda: read_json(run_dir / "syncer.json"), "syncer.json", alive=[popen])
        config = RunConfig.load(run_dir / "config.json")
        learner = Learner(config.diloco, learner_id=0, model=build_model(config.model))
        wire = WireModel(learner.spec, learner.plan, config.diloco.codec)
        channel = grpc.insecure_channel(info["address"])
        stub = wire_pb2_grpc.SyncerStub(channel)
        inbox: queue.Queue = queue.Queue()
        stream = stub.Subscribe(encode_join(learner.join_message(), config.diloco), metadata=metadata())
        threading.Thread(target=follow, args=(stream, wire, inbox), daemon=True).start()
        assert isinstance(inbox.get(timeout=PROCESS_WAIT_S), Welcome)
        handle = Syncer(run_dir, stub, config, learner, wire, inbox, procs)
        assert push(handle, good_update(handle)).accepted
        assert isinstance(inbox.get(timeout=PROCESS_WAIT_S), FragmentDelta)  # the int8 downlink
        assert state(handle)["rounds_committed"] == 1
        yield handle
    finally:
        if channel is not None:
            channel.close()
        procs.kill_all()


def status(syncer: Syncer) -> dict:
    return json.loads(syncer.stub.Status(wire_pb2.StatusRequest(), metadata=metadata(), timeout=CALL_TIMEOUT_S)
                      .status_json)


def state(syncer: Syncer) -> dict:
    s = status(syncer)
    return {"rounds_committed": s["rounds_committed"], "versions": s["versions"], "alive": s["alive_learners"]}


def good_update(syncer: Syncer, *, learner_id: int = 0, fragment: int = 0) -> Update:
    codec = get_codec(syncer.config.diloco.codec)
    shapes = syncer.wire.spec.by_name()
    generator = torch.Generator().manual_seed(7)
    payload = {name: codec.encode(1e-3 * torch.randn(shapes[name].shape, generator=generator))
               for name in syncer.wire.plan.fragments[fragment]}
    version = status(syncer)["versions"][fragment]
    return Update(learner_id, fragment, version, inner_step=8, steps=8, tokens=8 * 128,
                  codec=syncer.config.diloco.codec, payload=payload)


def chunks_of(syncer: Syncer, update: Update, chunk_bytes: int = CHUNK_BYTES) -> list[wire_pb2.UpdateChunk]:
    return list(encode_update(update, syncer.wire.spec, chunk_bytes))


def push(syncer: Syncer, update_or_chunks, md=None) -> wire_pb2.UpdateReply:
    chunks = chunks_of(syncer, update_or_chunks) if isinstance(update_or_chunks, Update) else update_or_chunks
    return syncer.stub.PushUpdate(iter(chunks), metadata=md or metadata(), timeout=CALL_TIMEOUT_S)


def refused(syncer: Syncer, call, *, code: grpc.StatusCode, reason: str, needle: str) -> str:
    """Run `call`, which must fail with `code` and a message containing `needle`; check the rejection
    was counted under `reason` and that the syncer's state did not move."""
    before_state, before_count = state(syncer), status(syncer)["rejections"].get(reason, 0)
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error = caught.value
    assert error.code() == code, error.details()
    assert needle in error.details(), error.details()
    assert status(syncer)["rejections"].get(reason, 0) == before_count + 1
    assert state(syncer) == before_state
    return error.details()


# ---- who may talk -----------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["wrong-token-0123456789abcdef", None])
def test_wrong_or_missing_token_is_unauthenticated(syncer, token):
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco)
    calls = [lambda: next(iter(syncer.stub.Subscribe(join, metadata=metadata(token=token), timeout=CALL_TIMEOUT_S))),
             lambda: push(syncer, good_update(syncer), md=metadata(token=token)),
             lambda: syncer.stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=0), metadata=metadata(token=token),
                                           timeout=CALL_TIMEOUT_S)]
    for call in calls:
        details = refused(syncer, call, code=grpc.StatusCode.UNAUTHENTICATED, reason="unauthenticated",
                          needle="run token")
        assert "--token-file" in details


def test_a_learner_cannot_act_for_another_and_the_run_token_acts_for_no_learner(syncer):
    # Issue 13 item 7. Before: anyone with the run token could push, heartbeat, subscribe or leave as any learner.
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco)  # learner 0
    as_1, run_token = metadata(learner=1), metadata(learner=None)
    for md, needle in ((as_1, "carries learner 1's token"), (run_token, "proves no learner")):
        calls = [lambda md=md: next(iter(syncer.stub.Subscribe(join, metadata=md, timeout=CALL_TIMEOUT_S))),
                 lambda md=md: push(syncer, good_update(syncer), md=md),
                 lambda md=md: syncer.stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=0), metadata=md,
                                                     timeout=CALL_TIMEOUT_S),
                 lambda md=md: syncer.stub.Leave(wire_pb2.LeaveRequest(learner_id=0), metadata=md,
                                                 timeout=CALL_TIMEOUT_S)]
        for call in calls:
            refused(syncer, call, code=grpc.StatusCode.UNAUTHENTICATED, reason="unauthenticated", needle=needle)
    assert 0 in status(syncer)["alive_learners"]  # learner 0 kept its stream throughout
    assert push(syncer, good_update(syncer)).accepted  # with its own token it still acts
    assert isinstance(syncer.inbox.get(timeout=PROCESS_WAIT_S), FragmentDelta)  # its round's result


def test_a_second_live_process_with_the_same_learner_id_is_refused_naming_the_first(syncer):
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco)
    join.learner_id = 1
    first = syncer.stub.Subscribe(join, metadata=metadata(learner=1, session="hostA/111/aaaa"), timeout=600)
    try:
        next(iter(first))  # its Welcome: learner 1 is connected and alive
        details = refused(syncer, lambda: next(iter(syncer.stub.Subscribe(
            join, metadata=metadata(learner=1, session="hostB/222/bbbb"), timeout=CALL_TIMEOUT_S))),
            code=grpc.StatusCode.FAILED_PRECONDITION, reason="another_process", needle="already connected")
        assert "process hostA/111 from" in details and "--learner-id 1" in details
        assert "aaaa" not in details  # the part of the session that would let a caller pass for that process
        # A join that names no process (no ddiloco-session metadata) cannot show it is the running one either.
        refused(syncer, lambda: next(iter(syncer.stub.Subscribe(join, metadata=metadata(learner=1),
                                                                 timeout=CALL_TIMEOUT_S))),
                code=grpc.StatusCode.FAILED_PRECONDITION, reason="another_process",
                needle="no ddiloco-session metadata")
        # The same process joining again (a re-join after a missed version) is not a second process.
        again = syncer.stub.Subscribe(join, metadata=metadata(learner=1, session="hostA/111/aaaa"), timeout=600)
        next(iter(again))
        again.cancel()
    finally:
        first.cancel()


def test_a_process_replaced_by_another_of_its_learner_id_can_no_longer_act_for_it(syncer):
    # Before: once another process had joined as learner 1 (the first's stream had ended, or it fell silent), the first
    # process's update was merged as learner 1's (the two trained the same data), its heartbeats kept learner 1 alive,
    # and its Leave made the process now holding learner 1 leave.
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco)
    join.learner_id = 1
    old_process, new_process = "hostA/111/cccc", "hostB/222/dddd"
    first = syncer.stub.Subscribe(join, metadata=metadata(learner=1, session=old_process), timeout=600)
    next(iter(first))
    first.cancel()  # its stream ends (a network blip): learner 1 is gone, its process lives on
    wait_until(lambda: 1 not in status(syncer)["alive_learners"], "learner 1 gone")
    second = syncer.stub.Subscribe(join, metadata=metadata(learner=1, session=new_process), timeout=600)
    try:
        next(iter(second))
        as_old = metadata(learner=1, session=old_process)
        for call in (lambda: push(syncer, good_update(syncer, learner_id=1), md=as_old),
                     lambda: syncer.stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=1), metadata=as_old,
                                                   timeout=CALL_TIMEOUT_S),
                     lambda: syncer.stub.Leave(wire_pb2.LeaveRequest(learner_id=1), metadata=as_old,
                                               timeout=CALL_TIMEOUT_S)):
            details = refused(syncer, call, code=grpc.StatusCode.FAILED_PRECONDITION, reason="another_process",
                              needle="process hostB/222 from")
            assert f"this process ({old_process}) was replaced" in details and "dddd" not in details
        assert 1 in status(syncer)["alive_learners"]  # the process holding learner 1 kept it
        # The process holding it acts as before. A call that names no process does not act for it: a Leave of the
        # learner's token without a session, in a loop, made the live process leave and join again 195 times in 8 s.
        assert syncer.stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=1), timeout=CALL_TIMEOUT_S,
                                     metadata=metadata(learner=1, session=new_process)).known
        no_session = metadata(learner=1)
        for call in (lambda: syncer.stub.Leave(wire_pb2.LeaveRequest(learner_id=1), metadata=no_session,
                                               timeout=CALL_TIMEOUT_S),
                     lambda: push(syncer, good_update(syncer, learner_id=1), md=no_session)):
            refused(syncer, call, code=grpc.StatusCode.FAILED_PRECONDITION, reason="another_process",
                    needle="names no process")
        assert 1 in status(syncer)["alive_learners"]
    finally:
        second.cancel()
    wait_until(lambda: 1 not in status(syncer)["alive_learners"], "learner 1 gone")


def _lines(text: str, needle: str) -> int:
    return sum(needle in line for line in text.splitlines())


@pytest.mark.acceptance  # the default suite's 15 minutes
def test_a_flood_of_unauthenticated_calls_is_counted_exactly_in_a_bounded_log(syncer):
    events = syncer.run_dir / "syncer" / "metrics.jsonl"
    before_count = status(syncer)["rejections"].get("unauthenticated", 0)
    before_log, before_events = _lines(syncer.procs.log("syncer"), "unauthenticated"), len(events.read_bytes())
    for _ in range(FLOOD_CALLS):
        with pytest.raises(grpc.RpcError) as caught:
            syncer.stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=0), metadata=metadata(token="wrong-token"),
                                  timeout=CALL_TIMEOUT_S)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert status(syncer)["rejections"]["unauthenticated"] == before_count + FLOOD_CALLS
    # At most one line in full and one summary per period (10 s) and peer: the flood takes a few seconds.
    assert _lines(syncer.procs.log("syncer"), "unauthenticated") - before_log <= FLOOD_LINES
    assert len(events.read_bytes()) - before_events <= FLOOD_LINES * 400
    # ... and the events still add up to the count, once the period's summary is out.
    def counted() -> int:
        lines = [json.loads(line) for line in events.read_text().splitlines()]
        return sum(e.get("count", 1) for e in lines
                   if e.get("event") in ("rejection", "rejections_suppressed") and e["reason"] == "unauthenticated")

    wait_until(lambda: counted() == before_count + FLOOD_CALLS, "the suppressed refusals summarised")


def test_wrong_schema_version_is_refused(syncer):
    refused(syncer, lambda: push(syncer, good_update(syncer), md=metadata(schema="99")),
            code=grpc.StatusCode.FAILED_PRECONDITION, reason="bad_schema", needle="schema version 99")
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco)
    join.learner_id, join.schema_version = 1, 99
    refused(syncer, lambda: next(iter(syncer.stub.Subscribe(join, metadata=metadata(learner=1),
                                                             timeout=CALL_TIMEOUT_S))),
            code=grpc.StatusCode.FAILED_PRECONDITION, reason="refused", needle="schema version 99")


# ---- who may join -------------------------------------------------------------------------------------

def _join_as_learner_1(syncer: Syncer, edit) -> None:
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco)
    join.learner_id = 1
    edit(join)
    next(iter(syncer.stub.Subscribe(join, metadata=metadata(learner=join.learner_id), timeout=CALL_TIMEOUT_S)))


def test_a_different_model_shape_is_refused_naming_the_parameter(syncer):
    def wider_head(join):
        head = next(t for t in join.model_spec if t.name == "lm_head.weight")
        head.shape[1] = 64

    details = refused(syncer, lambda: _join_as_learner_1(syncer, wider_head), code=grpc.StatusCode.FAILED_PRECONDITION,
                      reason="refused", needle="model differs")
    assert "'lm_head.weight' is float32[256, 64], expected float32[256, 32]" in details


def test_a_different_algorithm_config_is_refused_naming_the_field(syncer):
    def other_lr(join):
        join.diloco_config_json = join.diloco_config_json.replace('"outer_lr": 0.7', '"outer_lr": 0.5')

    refused(syncer, lambda: _join_as_learner_1(syncer, other_lr), code=grpc.StatusCode.FAILED_PRECONDITION,
            reason="refused", needle="outer_lr is 0.5 on the learner but 0.7 on the syncer")


def test_a_learner_id_outside_the_run_is_refused(syncer):
    refused(syncer, lambda: _join_as_learner_1(syncer, lambda join: setattr(join, "learner_id", 5)),
            code=grpc.StatusCode.FAILED_PRECONDITION, reason="refused", needle="outside 0..1")


def test_a_join_declaring_more_tokens_per_step_than_the_run_allows_is_refused(syncer):
    limit = syncer.config.quorum.max_tokens_per_step
    details = refused(syncer, lambda: _join_as_learner_1(syncer, lambda join: setattr(join, "max_tokens_per_step",
                                                                                        limit + 1)),
                      code=grpc.StatusCode.FAILED_PRECONDITION, reason="refused",
                      needle=f"declares up to {limit + 1} tokens per inner step")
    assert f"the run allows at most {limit} (max_tokens_per_step)" in details


@pytest.mark.parametrize("config_json, needle", [
    ("[" * 200_000 + "]" * 200_000, "characters: at most"),
    ("[" * 5000 + "]" * 5000, "nested more than"),
    ('{"outer_lr": ' + "9" * 5000 + "}", "5000 digits"),
])
def test_a_malformed_config_in_a_join_is_refused_and_recorded(syncer, config_json, needle):
    refused(syncer, lambda: _join_as_learner_1(syncer, lambda join: setattr(join, "diloco_config_json", config_json)),
            code=grpc.StatusCode.INVALID_ARGUMENT, reason="malformed", needle=needle)


def test_a_config_integer_beyond_what_the_field_takes_is_refused_naming_it(syncer):
    def huge(join):
        join.diloco_config_json = join.diloco_config_json.replace('"num_fragments": 2', f'"num_fragments": {2**64}')

    refused(syncer, lambda: _join_as_learner_1(syncer, huge), code=grpc.StatusCode.FAILED_PRECONDITION,
            reason="refused", needle=f"num_fragments is {2**64} on the learner but 2 on the syncer")


def test_a_model_spec_listing_a_tensor_twice_is_refused(syncer):
    refused(syncer, lambda: _join_as_learner_1(syncer, lambda join: join.model_spec.append(join.model_spec[0])),
            code=grpc.StatusCode.INVALID_ARGUMENT, reason="malformed", needle="twice")


def test_a_refusal_quoting_a_megabyte_of_input_is_a_short_clear_status(syncer):
    def huge_name(join):
        tensor = join.model_spec.add()
        tensor.CopyFrom(join.model_spec[0])
        tensor.name = "x" * 1_000_000  # quoted in full, the status would pass gRPC's 16 KiB metadata limit

    details = refused(syncer, lambda: _join_as_learner_1(syncer, huge_name), code=grpc.StatusCode.FAILED_PRECONDITION,
                      reason="refused", needle="unexpected parameter 'xxx")
    assert len(details) < 1000 and details.endswith("characters)")


def test_bytes_that_are_no_protobuf_message_are_refused_as_malformed(syncer):
    """gRPC itself would log a traceback for each (before any token check) and end the call INTERNAL, unrecorded."""
    join = encode_join(syncer.learner.join_message(), syncer.config.diloco).SerializeToString()
    bad_utf8 = join + b"\x22\x02\xff\xfe"  # diloco_config_json once more, as two bytes that are not UTF-8
    cut = b"\x12\x05ab"  # a 5-byte field that ends after 2
    with grpc.insecure_channel(read_json(syncer.run_dir / "syncer.json")["address"]) as channel:
        def raw(kind: str, name: str):  # a call that sends the bytes as they are
            return getattr(channel, kind)(f"/ddiloco.wire.Syncer/{name}", request_serializer=bytes,
                                          response_deserializer=bytes)

        subscribe, heartbeat, push = raw("unary_stream", "Subscribe"), raw("unary_unary", "Heartbeat"), \
            raw("stream_unary", "PushUpdate")
        refused(syncer, lambda: next(iter(subscribe(bad_utf8, metadata=metadata(), timeout=CALL_TIMEOUT_S))),
                code=grpc.StatusCode.INVALID_ARGUMENT, reason="malformed", needle="bad UTF-8")
        for call in (lambda md: heartbeat(cut, metadata=md, timeout=CALL_TIMEOUT_S),
                     lambda md: push(iter([cut]), metadata=md, timeout=CALL_TIMEOUT_S)):
            refused(syncer, lambda call=call: call(metadata()), code=grpc.StatusCode.INVALID_ARGUMENT,
                    reason="malformed", needle="not a valid protobuf message")
            refused(syncer, lambda call=call: call(metadata(token=None)), code=grpc.StatusCode.UNAUTHENTICATED,
                    reason="unauthenticated", needle="run token")
    assert "Exception deserializing" not in syncer.procs.log("syncer")


# ---- what an update may carry ---------------------------------------------------------------------------

def test_an_update_from_an_unknown_learner_is_refused(syncer):
    refused(syncer, lambda: push(syncer, good_update(syncer, learner_id=1), md=metadata(learner=1)),
            code=grpc.StatusCode.NOT_FOUND,
            reason="unknown_learner", needle="learner 1 has not joined")


def test_a_truncated_update_stream_is_refused(syncer):
    chunks = chunks_of(syncer, good_update(syncer), chunk_bytes=256)
    refused(syncer, lambda: push(syncer, chunks[:len(chunks) // 2]), code=grpc.StatusCode.INVALID_ARGUMENT,
            reason="truncated", needle="ended after")
    refused(syncer, lambda: push(syncer, []), code=grpc.StatusCode.INVALID_ARGUMENT, reason="truncated",
            needle="before its header")


def test_a_wrong_dtype_is_refused(syncer):
    chunks = chunks_of(syncer, good_update(syncer))
    chunks[0].header.tensors[0].dtype = "float16"
    refused(syncer, lambda: push(syncer, chunks), code=grpc.StatusCode.INVALID_ARGUMENT, reason="malformed",
            needle="dtype 'float16'")


def test_nan_values_are_refused(syncer):
    update = good_update(syncer)
    name = next(iter(update.payload))
    poisoned = bytearray(update.payload[name])
    poisoned[:4] = torch.tensor([math.nan], dtype=torch.float32).numpy().tobytes()  # int4: the first scale
    update = Update(**{**update.__dict__, "payload": {**update.payload, name: bytes(poisoned)}})
    refused(syncer, lambda: push(syncer, update), code=grpc.StatusCode.INVALID_ARGUMENT, reason="non_finite",
            needle="NaN")


def test_oversize_updates_are_refused(syncer):
    chunks = chunks_of(syncer, good_update(syncer))
    extra = [*chunks, wire_pb2.UpdateChunk(data=b"\0" * 1024)]
    refused(syncer, lambda: push(syncer, extra), code=grpc.StatusCode.RESOURCE_EXHAUSTED, reason="oversize",
            needle="more than")
    huge_chunk = [chunks[0], wire_pb2.UpdateChunk(data=b"\0" * (MAX_CHUNK_BYTES + 1))]
    refused(syncer, lambda: push(syncer, huge_chunk), code=grpc.StatusCode.RESOURCE_EXHAUSTED, reason="oversize",
            needle="exceeds the limit")

    def endless():  # declares 1 TB: refused on the header, long before the client would finish
        header = wire_pb2.UpdateChunk()
        header.CopyFrom(chunks[0])
        header.header.tensors[0].nbytes = 10**12
        yield header
        while True:
            yield wire_pb2.UpdateChunk(data=b"\0" * CHUNK_BYTES)

    refused(syncer, lambda: push(syncer, endless()), code=grpc.StatusCode.RESOURCE_EXHAUSTED, reason="oversize",
            needle="at most")


def test_core_rejections_travel_in_the_reply(syncer):
    update = good_update(syncer, fragment=1)
    assert push(syncer, update).accepted  # K = 1, no grace: the round commits at once
    assert isinstance(syncer.inbox.get(timeout=PROCESS_WAIT_S), FragmentDelta)
    before = state(syncer)
    reply = push(syncer, update)  # the same base again: it would count this learner's progress twice
    assert (reply.accepted, reply.reason) == (False, "stale")
    assert state(syncer) == before
    # ... and the syncer brings the learner up to date so that its next update is not stale too.
    current = syncer.inbox.get(timeout=PROCESS_WAIT_S)
    assert isinstance(current, FragmentState)  # the catch-up is the whole fragment, in float32
    assert (current.fragment, current.version) == (1, before["versions"][1])


def test_more_tokens_than_its_steps_may_count_is_rejected_as_bad_counters(syncer):
    # The merge weight is tokens^2 / steps: 2**53 tokens in 8 steps would have outweighed any honest learner.
    before, count = state(syncer), status(syncer)["rejections"].get("bad_counters", 0)
    reply = push(syncer, dataclasses.replace(good_update(syncer), tokens=2**53))
    assert (reply.accepted, reply.reason) == (False, "bad_counters")
    limit = syncer.config.quorum.max_tokens_per_step
    assert reply.detail == (f"tokens={2**53} in steps=8 is more than the {limit} tokens per inner step the run "
                            "allows (max_tokens_per_step)")
    assert status(syncer)["rejections"]["bad_counters"] == count + 1
    assert state(syncer) == before


def test_the_syncer_still_serves_after_all_of_it(syncer):
    before = state(syncer)
    assert push(syncer, good_update(syncer)).accepted
    message = syncer.inbox.get(timeout=PROCESS_WAIT_S)
    assert isinstance(message, FragmentDelta) and message.version == before["versions"][0] + 1
    assert state(syncer)["rounds_committed"] == before["rounds_committed"] + 1
    assert before["alive"] == [0]
