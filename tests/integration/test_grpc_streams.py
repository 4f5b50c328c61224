"""The syncer's gRPC server under many streams (issue 13 items 4 and 5), real gRPC on 127.0.0.1.

Before: each Subscribe held one of 64 server threads, so at 64 subscribers Status, Heartbeat and PushUpdate
timed out and learners 65-68 never got a Welcome; 63 uploads that sent a header and stalled blocked every
other call too. Now streams are coroutines and hold no thread; a stalled upload is refused after
`chunk_timeout_s`; a learner may have only UPLOADS_PER_LEARNER uploads in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import grpc
import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.learner import Learner
from ddiloco.messages import SCHEMA_VERSION, Update, Welcome
from ddiloco.metrics import NullSink
from ddiloco.model import build_model
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer
from ddiloco.train_tinygpt import initial_params
from ddiloco.transport import wire_pb2, wire_pb2_grpc
from ddiloco.transport.grpc_codec import WireModel, encode_join, encode_update
from ddiloco.transport.grpc_common import CHANNEL_OPTIONS, SCHEMA_KEY
from ddiloco.transport.grpc_server import start_server
from ddiloco.transport.syncer_servicer import UPLOADS_PER_LEARNER
from ddiloco.transport.syncer_stream import SyncerStreamDecoder
from tests.helpers import TINY_RUN

pytestmark = pytest.mark.integration

STREAMS = 80
"""More than the 64 server threads that used to be the limit."""
CALL_TIMEOUT_S = 20.0
METADATA = ((SCHEMA_KEY, str(SCHEMA_VERSION)),)


@contextlib.contextmanager
def serving(tmp_path, *, chunk_timeout_s: float = 60.0):
    run = dataclasses.replace(TINY_RUN, num_learners=STREAMS + 1)
    syncer = Syncer(run.diloco, run.quorum, initial_params=initial_params(run))
    service = SyncerService(run, syncer, SyncerStore(tmp_path), sink=NullSink())
    server, port = start_server(service, "127.0.0.1:0", token=None, chunk_timeout_s=chunk_timeout_s)
    service.start(f"127.0.0.1:{port}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        yield service, wire_pb2_grpc.SyncerStub(channel)
    finally:
        channel.close()
        service.close(server)


def learner() -> Learner:
    return Learner(TINY_RUN.diloco, learner_id=0, model=build_model(TINY_RUN.model))


def welcome_of(call, model: WireModel) -> Welcome:
    decoder = SyncerStreamDecoder(model)
    for chunk in call:
        message = decoder.feed(chunk)
        if message is not None:
            return message
    pytest.fail("the stream ended before its Welcome")


def test_many_subscribers_do_not_starve_other_calls(tmp_path):
    template = learner()
    model = WireModel(template.spec, template.plan, TINY_RUN.diloco.codec, TINY_RUN.diloco.downlink_codec)
    with serving(tmp_path) as (service, stub):
        calls = []
        try:
            for learner_id in range(STREAMS + 1):  # every one of them gets its Welcome, and stays subscribed
                request = encode_join(dataclasses.replace(template.join_message(), learner_id=learner_id),
                                      TINY_RUN.diloco)
                call = stub.Subscribe(request, metadata=METADATA, timeout=600)
                calls.append(call)
                assert isinstance(welcome_of(call, model), Welcome), learner_id
            assert service.status()["alive_learners"] == list(range(STREAMS + 1))
            # With every stream open, short calls still answer at once.
            assert stub.Heartbeat(wire_pb2.HeartbeatRequest(learner_id=3, inner_step=1), metadata=METADATA,
                                  timeout=CALL_TIMEOUT_S).known
            reply = stub.Status(wire_pb2.StatusRequest(), metadata=METADATA, timeout=CALL_TIMEOUT_S)
            assert '"rounds_committed": 0' in reply.status_json
        finally:
            for call in calls:
                call.cancel()


def stalled_upload(header: wire_pb2.UpdateChunk, release: threading.Event):
    """An upload that sends its header and then nothing, until released."""
    yield header
    release.wait()


def test_stalled_uploads_are_refused_after_the_chunk_timeout_and_block_nothing(tmp_path):
    joined = learner()
    model = WireModel(joined.spec, joined.plan, TINY_RUN.diloco.codec, TINY_RUN.diloco.downlink_codec)
    codec = get_codec(TINY_RUN.diloco.codec)
    payload = {name: codec.encode(torch.zeros(joined.spec.by_name()[name].shape)) for name in joined.plan.fragments[0]}
    update = Update(0, 0, 0, 8, 8, 64, TINY_RUN.diloco.codec, payload)
    header = next(encode_update(update, joined.spec))
    release = threading.Event()
    with serving(tmp_path, chunk_timeout_s=2.0) as (service, stub):
        subscription = stub.Subscribe(encode_join(joined.join_message(), TINY_RUN.diloco), metadata=METADATA,
                                      timeout=600)
        try:
            welcome_of(subscription, model)
            stalled = [stub.PushUpdate.future(stalled_upload(header, release), metadata=METADATA, timeout=600)
                       for _ in range(70)]
            # 70 stalled uploads of learner 0: Status answers meanwhile; all but UPLOADS_PER_LEARNER are refused
            # at once, those after the chunk timeout, each with a recorded reason.
            assert stub.Status(wire_pb2.StatusRequest(), metadata=METADATA, timeout=CALL_TIMEOUT_S).status_json
            codes = []
            for future in stalled:
                with pytest.raises(grpc.RpcError) as error:
                    future.result(timeout=CALL_TIMEOUT_S)
                codes.append(error.value.code())
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 70 - UPLOADS_PER_LEARNER
            assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == UPLOADS_PER_LEARNER
            rejections = service.status()["rejections"]
            assert rejections["too_many_uploads"] == 70 - UPLOADS_PER_LEARNER
            assert rejections["truncated"] == UPLOADS_PER_LEARNER
        finally:
            release.set()
            subscription.cancel()
