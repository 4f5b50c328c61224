"""How a `ddiloco.Session` moves messages: to an in-process hub, or over gRPC through `LearnerIO`.

Both offer the same small surface to the session (start, send, take what arrived, wait, flush, close,
counters); the session's rules never depend on which one carries the messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ddiloco.clock import Clock
from ddiloco.config import DilocoConfig
from ddiloco.inprocess import InProcessHub
from ddiloco.learner import Learner
from ddiloco.learner_rules import LearnerRules
from ddiloco.messages import Join, LearnerMessage, Leave, SyncerMessage
from ddiloco.run_config import RunConfig


class SessionTransport(Protocol):
    connected: bool
    unreachable: str | None
    """Why the transport gave up on a syncer that never answered (the session then stops), else None."""

    def start(self) -> None: ...
    def send(self, message: LearnerMessage) -> None: ...
    def take_ready_at(self) -> list[tuple[float | None, SyncerMessage]]:
        """What has arrived, each with its arrival time on the session's clock (None: now)."""
    def wait(self, timeout_s: float | None) -> None: ...
    def wake(self) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...
    def close(self, *, leave: bool) -> None: ...
    def counters(self) -> dict[str, int]: ...


class HubTransport:
    """The in-process hub: delivery is immediate, and nothing may block (one thread may drive many
    learners), so `wait` only lets the hub close rounds whose grace window has ended."""

    blocking = False

    unreachable = None
    """A hub in this process is always reached."""

    def __init__(self, hub: InProcessHub, learner: Learner) -> None:
        self.hub = hub
        self.learner = learner
        self._inbox: list[SyncerMessage] = []
        self.connected = False

    def _genesis(self) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
        params = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self.learner.model.named_parameters()}
        return params, tuple(sorted(self.learner.embeddings))

    def start(self) -> None:
        self.hub.connect(self.learner.learner_id, self._inbox.append, genesis=self._genesis)
        self.connected = True
        self.hub.send(self.learner.join_message())

    def send(self, message: LearnerMessage) -> None:
        self.hub.send(message)

    def take_ready_at(self) -> list[tuple[float | None, SyncerMessage]]:
        ready = [(None, message) for message in self._inbox]  # delivered as it is sent: its arrival is now
        self._inbox.clear()  # in place: the hub holds this very list's append
        return ready

    def wait(self, timeout_s: float | None) -> None:
        self.hub.advance()

    def wake(self) -> None:
        pass

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self, *, leave: bool) -> None:
        if leave:
            self.hub.send(Leave(self.learner.learner_id))
        self.hub.disconnect(self.learner.learner_id)
        self.connected = False

    def counters(self) -> dict[str, int]:
        stats = self.learner.stats
        return {"updates_accepted": 0, "updates_rejected": sum(stats.rejections.values()), "updates_dropped": 0,
                "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "joins": stats.joins,
                "genesis_bytes_sent": 0}  # the hub takes the first learner's parameters in process


def check_join_fits(join: Join, config: DilocoConfig) -> None:
    """ValueError when the learner's join, which describes every tensor of its model (name, dtype, shape) in one gRPC
    message, is larger than one data chunk may be (`MAX_CHUNK_BYTES`: the message limit keeps 1 MiB beside that for
    headers, and the Welcome describes the model again with sizes). A model of about 100,000 tensors does not fit:
    its learner retried the join for as long as it ran, each time `RESOURCE_EXHAUSTED: Sent message larger than
    max`."""
    from ddiloco.transport.grpc_codec import MAX_CHUNK_BYTES, encode_join

    size = encode_join(join, config).ByteSize()
    if size > MAX_CHUNK_BYTES:
        raise ValueError(f"the model has {len(join.model_spec.tensors):,} parameter tensors: their description alone "
                         f"is {size / 2**20:.1f} MiB, more than the {MAX_CHUNK_BYTES / 2**20:.0f} MiB a message "
                         "between a learner and the syncer may hold. Fuse small tensors (a mixture of experts' "
                         "experts into one tensor per layer, as transformers does) so that the model has fewer")


class GrpcTransport:
    """The real runtime: `LearnerIO`'s threads around one `SyncerClient`."""

    blocking = True

    def __init__(self, learner: Learner, rules: LearnerRules, *, address: str, token: str | None,
                 config: RunConfig, link: str | None, tls_ca: bytes | None, tls_server_name: str | None,
                 chaos: Any, clock: Clock,
                 genesis_params: Callable[[], Mapping[str, torch.Tensor] | None] | None = None) -> None:
        """`genesis_params`: the full initial parameters to propose as the run's genesis, where the model's own
        are not (sharded across ranks: `Session._gather_genesis`); default: the model's."""
        from ddiloco.transport.genesis_codec import Genesis
        from ddiloco.transport.grpc_client import SyncerClient
        from ddiloco.transport.grpc_codec import WireModel
        from ddiloco.transport.learner_io import LearnerIO
        from ddiloco.transport.link import NO_FAULTS, EmulatedLink, check_link, parse_link, unlimited_link

        faults = chaos or NO_FAULTS
        if link:  # a latency past the heartbeat timeout: the syncer would drop this learner before its messages arrive
            check_link(parse_link(link), heartbeat_timeout_s=config.quorum.heartbeat_timeout_s)
        emulated = EmulatedLink(parse_link(link), faults=faults) if link else unlimited_link(faults=faults)
        wire = WireModel(learner.spec, learner.plan, config.diloco.codec, config.diloco.downlink_codec)
        self.client = SyncerClient(address, model=wire,
                                   diloco_config=config.diloco, token=token, tls_root_certificates=tls_ca,
                                   tls_server_name=tls_server_name, link=emulated)

        def genesis() -> Genesis:
            given = genesis_params() if genesis_params is not None else None
            params = dict(given) if given is not None else {n: p.detach() for n, p in learner.model.named_parameters()}
            return Genesis(learner.learner_id, params, tuple(sorted(learner.embeddings)), learner.aliases)

        join = learner.join_message()
        check_join_fits(join, config.diloco)
        self.io = LearnerIO(self.client, join, heartbeat_every_s=config.learner.heartbeat_every_s,
                            clock=clock, on_fate=rules.fate, genesis=genesis,
                            connect_timeout_s=config.learner.connect_timeout_s)
        self.learner = learner

    @property
    def connected(self) -> bool:
        return self.io.connected

    @property
    def unreachable(self) -> str | None:
        return self.io.unreachable

    def start(self) -> None:
        self.io.start()

    def send(self, message: LearnerMessage) -> None:
        self.io.inner_step = self.learner.inner_step
        self.io.send(message)

    def take_ready_at(self) -> list[tuple[float | None, SyncerMessage]]:
        if self.io.failure is not None:
            raise RuntimeError(f"the learner's connection to the syncer failed: {type(self.io.failure).__name__}: "
                               f"{self.io.failure}") from self.io.failure
        self.io.inner_step = self.learner.inner_step
        return list(self.io.inbox.take_ready_at())

    def wait(self, timeout_s: float | None) -> None:
        self.io.inbox.wait(timeout_s)

    def wake(self) -> None:
        # Possibly from a signal handler: the inbox's wake waits for no lock. (Not a thread started to wake it: a
        # handler that interrupted this thread inside `Thread.start` waited for ever on the lock that holds.)
        self.io.inbox.wake()

    def flush(self, timeout_s: float) -> bool:
        return self.io.flush(timeout_s)

    def close(self, *, leave: bool) -> None:
        self.io.close(leave=leave)

    def counters(self) -> dict[str, int]:
        io = self.io.stats
        return {"updates_accepted": io.updates_accepted, "updates_rejected": io.updates_rejected,
                "updates_dropped": io.updates_dropped, "bytes_sent": self.client.bytes_sent,
                "bytes_received": self.client.bytes_received, "joins": io.welcomes,
                "genesis_bytes_sent": self.client.genesis_bytes_sent}
