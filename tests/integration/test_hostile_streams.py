"""Streams that a client opens and never reads, against a syncer service in this process over real gRPC on 127.0.0.1.

The model is large enough (6.6 MB of float32) that a Welcome does not fit in gRPC's flow-control windows: a stream
whose client does not read stays blocked in the middle of it. Before: 200 such Subscribe calls of one learner (each
replacing the one before) or 200 Watch calls held 12-17 MB each until the connections died (syncer RSS 398 -> 3360
MiB), and any learner's token could Watch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref

import grpc
import pytest

from ddiloco.learner import Learner
from ddiloco.messages import SCHEMA_VERSION, Welcome
from ddiloco.metrics import NullSink
from ddiloco.model import ModelConfig, build_model
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer
from ddiloco.train_tinygpt import initial_params
from ddiloco.transport import syncer_servicer, wire_pb2, wire_pb2_grpc
from ddiloco.transport.auth import learner_token
from ddiloco.transport.grpc_codec import encode_join
from ddiloco.transport.grpc_common import CHANNEL_OPTIONS, SCHEMA_KEY, SESSION_KEY, TOKEN_KEY
from ddiloco.transport.grpc_server import start_server
from ddiloco.transport.syncer_servicer import STREAMS_PER_LEARNER, WATCHES_AT_ONCE
from tests.helpers import TINY_RUN, wait_until

pytestmark = pytest.mark.integration

TOKEN = "hostile-streams-test-token-0123456789"
RUN = dataclasses.replace(TINY_RUN, model=ModelConfig(width=256, num_heads=2, num_layers=2, context_len=32),
                          num_learners=2)
CALL_TIMEOUT_S = 20.0
LET_GO_S = 5.0
"""Bound on the wait for a replaced stream to let go of its Welcome (it takes milliseconds)."""


def metadata(learner: int | None, session: str = "one-process"):
    token = TOKEN if learner is None else learner_token(TOKEN, learner)
    return ((TOKEN_KEY, token), (SCHEMA_KEY, str(SCHEMA_VERSION)), (SESSION_KEY, session))


@contextlib.contextmanager
def serving(tmp_path):
    syncer = Syncer(RUN.diloco, RUN.quorum, initial_params=initial_params(RUN))
    service = SyncerService(RUN, syncer, SyncerStore(tmp_path), sink=NullSink())
    server, port = start_server(service, "127.0.0.1:0", token=TOKEN)
    service.start(f"127.0.0.1:{port}")
    channels: list[grpc.Channel] = []

    def stub() -> wire_pb2_grpc.SyncerStub:
        """A stub on a connection of its own (a client that does not read blocks no other)."""
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS))
        return wire_pb2_grpc.SyncerStub(channels[-1])

    try:
        yield service, stub
    finally:
        for channel in channels:
            channel.close()
        service.close(server)


@pytest.fixture
def welcomes(monkeypatch) -> list[weakref.ref]:
    """A weak reference to every Welcome the server encodes."""
    refs: list[weakref.ref] = []
    encode = syncer_servicer.encode_syncer_message

    def recording(message, *args, **kwargs):
        if isinstance(message, Welcome):
            refs.append(weakref.ref(message))
        return encode(message, *args, **kwargs)

    monkeypatch.setattr(syncer_servicer, "encode_syncer_message", recording)
    return refs


def test_a_replaced_subscription_lets_go_of_its_welcome_and_a_learner_holds_few_streams(tmp_path, welcomes):
    join = encode_join(Learner(RUN.diloco, learner_id=1, model=build_model(RUN.model)).join_message(), RUN.diloco)
    with serving(tmp_path) as (service, stub):
        calls = []
        try:
            for _ in range(STREAMS_PER_LEARNER):  # one process joining again and again, reading one chunk each time
                calls.append(stub().Subscribe(join, metadata=metadata(1), timeout=600))
                assert next(calls[-1]).HasField("welcome")
            assert len(welcomes) == STREAMS_PER_LEARNER
            # Each replaced stream stopped in the middle of its Welcome and let go of it; the current one holds its own.
            wait_until(lambda: all(ref() is None for ref in welcomes[:-1]), "the replaced streams' Welcomes freed",
                       timeout_s=LET_GO_S)
            assert welcomes[-1]() is not None
            # What gRPC holds for them goes only when their client cancels them or goes: until then they count.
            with pytest.raises(grpc.RpcError) as refused:
                next(stub().Subscribe(join, metadata=metadata(1), timeout=CALL_TIMEOUT_S))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            assert "too_many_streams" in refused.value.details()
            assert service.status()["rejections"] == {"too_many_streams": 1}
            assert service.status()["alive_learners"] == [1]
        finally:
            for call in calls:
                call.cancel()


def test_watch_is_the_operators_and_bounded(tmp_path):
    at_once = wire_pb2.WatchRequest(min_interval_s=0)
    with serving(tmp_path) as (service, stub):
        with pytest.raises(grpc.RpcError) as refused:  # a learner's token proves one learner, not the operator
            next(stub().Watch(at_once, metadata=metadata(1), timeout=CALL_TIMEOUT_S))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
        calls = []
        try:
            for _ in range(WATCHES_AT_ONCE):  # watchers that read one chunk of the model, and no more
                calls.append(stub().Watch(at_once, metadata=metadata(None), timeout=600))
                assert next(calls[-1]).HasField("welcome")
            with pytest.raises(grpc.RpcError) as refused:
                next(stub().Watch(at_once, metadata=metadata(None), timeout=CALL_TIMEOUT_S))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            assert "too_many_watches" in refused.value.details()
            assert service.status()["rejections"] == {"unauthenticated": 1, "too_many_watches": 1}
            status = stub().Status(wire_pb2.StatusRequest(), metadata=metadata(None), timeout=CALL_TIMEOUT_S)
            assert json.loads(status.status_json)["genesis"]  # the server answers meanwhile
        finally:
            for call in calls:
                call.cancel()
