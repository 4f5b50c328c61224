"""A learner's genesis upload takes its emulated link's time (`--link`), as its updates do: it went out at once, so a
run over a 1 bit/s link had its model at the syncer in 2 s, and start-up times over emulated links read too fast."""

from __future__ import annotations

import time

import torch

from ddiloco.messages import Join, ModelSpec
from ddiloco.transport.genesis_codec import Genesis
from ddiloco.transport.learner_io import LearnerIO
from ddiloco.transport.link import MIN_BURST_BYTES, EmulatedLink, LinkConfig
from tests.helpers import StubSyncerClient

VALUES = 25_000
"""float32 values of the genesis: 100 kB, 0.33 s over the 2 Mbit/s link below beyond its burst allowance."""


class Syncer(StubSyncerClient):
    def __init__(self) -> None:
        self.link = EmulatedLink(LinkConfig(bandwidth_bps=2e6, latency_s=0.0))
        self.pushed_at: float | None = None

    def push_genesis(self, genesis: Genesis, **kwargs) -> bool:
        self.pushed_at = time.monotonic()
        return True


def test_a_genesis_waits_for_its_bytes_to_cross_the_emulated_link():
    syncer = Syncer()
    genesis = Genesis(0, {"w": torch.zeros(VALUES)}, ())
    io = LearnerIO(syncer, Join(0, ModelSpec(()), "x"), heartbeat_every_s=60.0, genesis=lambda: genesis)
    started = time.monotonic()
    assert io._propose_genesis() is True
    link_s = (VALUES * 4 - MIN_BURST_BYTES) * 8 / 2e6
    assert syncer.pushed_at is not None and syncer.pushed_at - started >= 0.9 * link_s  # load only makes it later
