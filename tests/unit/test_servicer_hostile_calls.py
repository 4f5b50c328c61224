"""The syncer's gRPC calls against hostile uploads, without sockets: the servicer's coroutines driven directly.

A `Context` stands in for grpc.aio's ServicerContext (it keeps the exception its `abort` raised, as grpc.aio
does), a `Handler` for the syncer service, and `GatedPool` wraps a real thread pool so that a call's rejection
can be queued behind a busy thread while the call is cancelled, as gRPC cancels a call whose client died. Memory is
measured with tracemalloc (the receive buffers are Python bytearrays), with the cyclic garbage collector off so
that a buffer only a reference cycle holds counts as held.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import tracemalloc
from concurrent import futures

import grpc
import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.fragments import FragmentPlan
from ddiloco.messages import SCHEMA_VERSION, ModelSpec, TensorSpec, Update
from ddiloco.transport import wire_pb2
from ddiloco.transport.auth import learner_token
from ddiloco.transport.grpc_codec import CHUNK_BYTES, WireModel, encode_join, encode_update
from ddiloco.transport.grpc_common import NO_GENESIS, SCHEMA_KEY, TOKEN_KEY
from ddiloco.transport.syncer_servicer import SyncerServicer

TOKEN = "servicer-hostile-calls-token-0123"
VALUES = 1 << 20
"""One float32 tensor of this many values: a 4 MiB update (fp32) or genesis."""
DECLARED_BYTES = 256 << 20
"""What a hostile genesis header claims (and never sends)."""
ALLOWED_BYTES = 8 << 20
"""Python memory a refused call may take above what the test itself holds: a few chunks, never the declared size."""
FREED_BYTES = 1 << 20
"""Python memory a finished call may still hold: its small objects, never its buffer."""
MODEL = WireModel(ModelSpec((TensorSpec("w", (VALUES,), "float32"),)), FragmentPlan((("w",),), frozenset()), "fp32")


class Aborted(grpc.aio.AbortError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    """What the servicer uses of grpc.aio's ServicerContext."""

    def __init__(self, token: str) -> None:
        self._metadata = ((TOKEN_KEY, token), (SCHEMA_KEY, str(SCHEMA_VERSION)))
        self.aborted: Aborted | None = None
        self.trailing = ()

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata

    def cancelled(self) -> bool:
        return False

    async def abort(self, code: grpc.StatusCode, details: str):
        self.aborted = Aborted(code, details)  # grpc.aio keeps it too (RPCState.abort_exception)
        raise self.aborted


class Handler:
    """The syncer service as the servicer sees it: a run that has its model (or none yet), every learner a member."""

    def __init__(self, model: WireModel | None) -> None:
        self.model = model
        self.rejections: list[tuple[str, str, int | None]] = []
        self.proposed = []

    def wire_model(self) -> WireModel | None:
        return self.model

    def join(self, join, diloco_config, peer, session=""):
        return NO_GENESIS if self.model is None else "refused in this test"

    def is_member(self, learner_id: int) -> bool:
        return True

    def replaced(self, learner_id: int, session: str) -> str | None:
        return None

    def watch_refusal(self, declared: dict | None) -> str | None:
        return None

    def genesis(self, genesis, peer):
        self.proposed.append(genesis)
        return True, ""

    def update(self, update):
        return True, "", ""

    def record_rejection(self, reason, detail, *, learner_id, peer, fragment=None, inner_step=None) -> None:
        self.rejections.append((reason, detail, learner_id))


class GatedPool:
    """A real one-thread pool; while `cancel_on_rejection` is set, a rejection submitted to it waits behind a busy
    thread, and the call that submitted it is cancelled meanwhile (gRPC cancels the call of a client that died)."""

    def __init__(self, handler: Handler) -> None:
        self._pool = futures.ThreadPoolExecutor(max_workers=1)
        self._handler = handler
        self.gate = threading.Event()
        self.cancel_on_rejection: asyncio.Task | None = None

    def submit(self, fn, /, *args, **kwargs):
        if getattr(fn, "func", fn) == self._handler.record_rejection and self.cancel_on_rejection is not None:
            self._pool.submit(self.gate.wait)
            self.cancel_on_rejection.get_loop().call_soon(self.cancel_on_rejection.cancel)
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self.gate.set()
        self._pool.shutdown(wait=True)


@contextlib.contextmanager
def servicer_of(handler: Handler):
    pool = GatedPool(handler)
    try:
        yield SyncerServicer(handler, token=TOKEN, pool=pool), pool
    finally:
        pool.shutdown()


async def stream(chunks):
    for chunk in chunks:
        yield chunk


def genesis_header(learner_id: int, nbytes: int) -> wire_pb2.GenesisChunk:
    return wire_pb2.GenesisChunk(header=wire_pb2.GenesisHeader(learner_id=learner_id, tensors=[
        wire_pb2.TensorHeader(name="w", dtype="float32", shape=[nbytes // 4], nbytes=nbytes)]))


def data_chunks(count: int):
    """`count` genesis data chunks of CHUNK_BYTES, made as they are read (the test holds none of them)."""
    for _ in range(count):
        yield wire_pb2.GenesisChunk(data=bytes(CHUNK_BYTES))


def run(call) -> object:
    """The call's reply, or the Aborted it ended with."""
    try:
        return asyncio.run(call)
    except Aborted as exc:
        return exc


@contextlib.contextmanager
def python_memory():
    """{'peak': most Python bytes held above the start while inside, 'held': bytes still held at the end}; no
    cyclic garbage collection meanwhile."""
    measured: dict[str, int] = {}
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield measured
        current, peak = tracemalloc.get_traced_memory()
        measured.update(peak=peak - start, held=current - start)
    finally:
        tracemalloc.stop()
        gc.enable()


def ask_for_genesis(servicer: SyncerServicer) -> None:
    """A learner subscribes and is answered no_genesis: the syncer now waits for its initial parameters."""
    from ddiloco.config import DilocoConfig
    from ddiloco.messages import Join

    join = encode_join(Join(2, MODEL.spec, "fingerprint", SCHEMA_VERSION), DilocoConfig())

    answer = run(servicer.Subscribe(join, Context(learner_token(TOKEN, 2))))
    assert isinstance(answer, Aborted) and NO_GENESIS in answer.details


# ---- PushGenesis ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("token, expected", [
    (learner_token(TOKEN, 2), None),  # the learner itself: told the run has its genesis
    (TOKEN, grpc.StatusCode.UNAUTHENTICATED),  # the run token proves no learner
    (learner_token(TOKEN, 1), grpc.StatusCode.UNAUTHENTICATED),  # learner 1 claiming learner 2
], ids=["own-token", "run-token", "another-learner"])
def test_a_genesis_header_costs_nothing_before_its_caller_and_the_run_want_it(token, expected):
    # Before: the header's 256 MiB were allocated and zero-filled on the event loop before anything was checked.
    handler = Handler(MODEL)  # the run has its model
    with servicer_of(handler) as (servicer, _), python_memory() as memory:
        answer = run(servicer.PushGenesis(stream([genesis_header(2, DECLARED_BYTES)]), Context(token)))
    assert memory["peak"] < ALLOWED_BYTES, f"{memory['peak']} bytes for a header alone"
    if expected is None:
        assert isinstance(answer, wire_pb2.GenesisReply) and not answer.accepted, answer
        assert "already has its genesis" in answer.detail
    else:
        assert isinstance(answer, Aborted) and answer.code == expected, answer
        assert [reason for reason, _, _ in handler.rejections] == ["unauthenticated"]
    assert not handler.proposed


def test_a_genesis_the_syncer_did_not_ask_for_is_not_read():
    handler = Handler(None)  # no model yet, but no learner was told no_genesis (a run with --init)
    with servicer_of(handler) as (servicer, _), python_memory() as memory:
        chunks = stream([genesis_header(2, 4 * CHUNK_BYTES), *data_chunks(4)])
        answer = run(servicer.PushGenesis(chunks, Context(learner_token(TOKEN, 2))))
    assert memory["peak"] < ALLOWED_BYTES
    assert isinstance(answer, wire_pb2.GenesisReply) and not answer.accepted and "did not ask" in answer.detail
    assert not handler.proposed


def test_a_genesis_larger_than_the_syncer_can_hold_is_a_counted_refusal():
    # Before: a 1 TiB header (exactly the old MAX_GENESIS_BYTES) raised MemoryError: UNKNOWN, nothing counted.
    handler = Handler(None)
    with servicer_of(handler) as (servicer, _):
        ask_for_genesis(servicer)
        answer = run(servicer.PushGenesis(stream([genesis_header(2, 1 << 40)]), Context(learner_token(TOKEN, 2))))
    assert isinstance(answer, Aborted), answer
    assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "oversize" in answer.details
    assert [reason for reason, _, _ in handler.rejections] == ["oversize"]


def test_a_genesis_grows_with_its_data_and_a_refused_one_lets_go_of_it_at_once():
    # Before: the declared 64 MiB were allocated at the header, and a refused call's buffer stayed in a reference
    # cycle (the abort raised inside `except WireError`) until the garbage collector ran.
    handler = Handler(None)
    with servicer_of(handler) as (servicer, _):
        ask_for_genesis(servicer)
        context = Context(learner_token(TOKEN, 2))
        with python_memory() as memory:
            chunks = stream([genesis_header(2, 64 << 20), *data_chunks(4)])  # then the stream ends: truncated
            answer = run(servicer.PushGenesis(chunks, context))
    assert isinstance(answer, Aborted) and "truncated" in answer.details, answer
    assert memory["peak"] < 4 * CHUNK_BYTES + ALLOWED_BYTES, f"{memory['peak']} bytes for 4 MiB sent"
    assert memory["held"] < FREED_BYTES, f"{memory['held']} bytes still held by the refused call"
    assert [reason for reason, _, _ in handler.rejections] == ["truncated"]


def test_one_genesis_upload_per_learner_at_a_time():
    handler = Handler(None)
    with servicer_of(handler) as (servicer, _):
        ask_for_genesis(servicer)
        waiting, release = asyncio.Event(), asyncio.Event()

        async def stalled():
            yield genesis_header(2, 4 * CHUNK_BYTES)
            waiting.set()  # the header is taken: the upload waits for its data
            await release.wait()

        async def both():
            first = asyncio.ensure_future(servicer.PushGenesis(stalled(), Context(learner_token(TOKEN, 2))))
            await waiting.wait()
            second = await asyncio.gather(servicer.PushGenesis(stalled(), Context(learner_token(TOKEN, 2))),
                                          return_exceptions=True)
            release.set()
            await asyncio.gather(first, return_exceptions=True)
            return second[0]

        answer = asyncio.run(both())
    assert isinstance(answer, Aborted) and answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED, answer
    assert "too_many_uploads" in answer.details


# ---- PushUpdate ------------------------------------------------------------------------------------------------

def update_chunks(*, corrupt: bool = False) -> list[wire_pb2.UpdateChunk]:
    payload = {"w": get_codec("fp32").encode(torch.ones(VALUES))}
    chunks = list(encode_update(Update(0, 0, 0, 8, 8, 64, "fp32", payload), MODEL.spec))
    if corrupt:
        chunks[1].data = bytes(len(chunks[1].data))
    return chunks


def test_a_refused_update_lets_go_of_its_buffer_at_once():
    handler = Handler(MODEL)
    chunks = update_chunks(corrupt=True)
    with servicer_of(handler) as (servicer, _):
        context = Context(learner_token(TOKEN, 0))
        with python_memory() as memory:
            answer = run(servicer.PushUpdate(stream(chunks), context))
    assert isinstance(answer, Aborted) and "corrupt" in answer.details, answer
    assert memory["held"] < FREED_BYTES, f"{memory['held']} bytes still held by the refused update"


def test_an_update_whose_client_dies_is_counted_even_when_the_call_is_cancelled_meanwhile():
    # A client that dies mid-upload: gRPC ends its stream, and then cancels the call. Before: when the cancellation
    # came while the refusal's record waited for a thread, the record was cancelled with it (3 of 12 in the
    # tester's run were recorded nowhere).
    handler = Handler(MODEL)
    chunks = update_chunks()[:2]  # the header and one data chunk, then the stream ends
    with servicer_of(handler) as (servicer, pool):
        async def upload():
            task = asyncio.ensure_future(servicer.PushUpdate(stream(chunks), Context(learner_token(TOKEN, 0))))
            pool.cancel_on_rejection = task
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return task

        assert asyncio.run(upload()).cancelled()
        pool.shutdown()  # the rejection queued behind the gate runs now, if it still may
    assert [(reason, learner) for reason, _, learner in handler.rejections] == [("truncated", 0)]


def test_an_update_cancelled_while_waiting_for_a_chunk_is_counted():
    handler = Handler(MODEL)
    waiting, release = asyncio.Event(), asyncio.Event()

    async def stalled():
        yield update_chunks()[0]
        waiting.set()  # the header is in: the upload waits for its next chunk
        await release.wait()

    with servicer_of(handler) as (servicer, pool):
        async def upload():
            task = asyncio.ensure_future(servicer.PushUpdate(stalled(), Context(learner_token(TOKEN, 0))))
            await waiting.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(upload())
        pool.shutdown()
    assert [(reason, learner) for reason, _, learner in handler.rejections] == [("truncated", 0)]


def test_memory_a_receiver_cannot_get_is_a_refusal_not_a_memory_error():
    from ddiloco.transport.grpc_codec import WireError, _Receiver

    receiver = _Receiver(1 << 50)  # a petabyte, allocated at its first byte
    with pytest.raises(WireError) as refused:
        receiver.add(b"\0")
    assert refused.value.reason == "oversize" and refused.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
