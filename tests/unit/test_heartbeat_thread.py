"""Heartbeats go out while an upload takes long (a large update over a slow link): they have their own thread.

Before: the sender thread sent them between uploads only, and a push longer than the heartbeat timeout let the syncer
time the learner out in the middle of it and refuse its update (probe: a 76 KB update at 2 kB/s, 38 s)."""

import threading
import time

from ddiloco.messages import Join, ModelSpec, Update
from ddiloco.transport.learner_io import LearnerIO
from tests.helpers import StubSyncerClient


class SlowUploadClient(StubSyncerClient):
    """A subscription that stays open; a push that takes `push_s`; heartbeats counted by when they came."""

    def __init__(self, push_s: float) -> None:
        self.link = type("Link", (), {"send_at": staticmethod(lambda nbytes: 0.0)})()  # no emulated link
        self.push_s = push_s
        self.heartbeats: list[float] = []
        self.pushing = threading.Event()
        self.pushed = threading.Event()
        self._closed = threading.Event()

    def subscribe(self, join):
        self._closed.wait()
        return iter(())

    def cancel_subscription(self):
        self._closed.set()

    def encode_update(self, update):
        return update

    def push(self, chunks, **kwargs):
        self.pushing.set()
        time.sleep(self.push_s)
        self.pushed.set()
        return type("Reply", (), {"accepted": True})()

    def heartbeat(self, learner_id, inner_step, **kwargs):
        self.heartbeats.append(time.monotonic())
        return True


def test_heartbeats_go_out_while_an_update_uploads():
    client = SlowUploadClient(push_s=1.0)
    io = LearnerIO(client, Join(0, ModelSpec(()), "x"), heartbeat_every_s=0.1)
    io.start()
    try:
        io.send(Update(0, 0, 0, 1, 1, 1, "fp32", {}))  # payload_bytes 0
        assert client.pushing.wait(10) and client.pushed.wait(10)
        started = time.monotonic() - client.push_s
        during = [t for t in client.heartbeats if started < t < started + client.push_s]
        assert len(during) >= 5, f"{len(during)} heartbeats during a 1 s upload, one every 0.1 s expected"
    finally:
        io.close(leave=False)
