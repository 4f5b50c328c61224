"""What the syncer's gRPC server asks of the service behind it: the `SyncerHandler` protocol.

The server (`grpc_server`, `syncer_servicer`) checks the bytes and the caller; the handler (the syncer service of
`ddiloco.runtime`, which owns the Syncer core and its lock) decides. Besides the protocol this module holds the
terms both sides read the same way: `STOPPED`, the answer that ends a watch, and `peer_host`, how a peer string the
server passes names the client's host. It holds no gRPC call and no state.
"""

from __future__ import annotations

from typing import Protocol

from ddiloco.messages import Heartbeat, Join, Leave, Update, Welcome
from ddiloco.transport.genesis_codec import Genesis
from ddiloco.transport.grpc_codec import WireModel
from ddiloco.transport.subscription import Subscription

STOPPED = "stopped"
"""`SyncerHandler.snapshot`'s answer once the syncer stops."""


class AnotherProcess(str):
    """A join's refusal because another live process holds the learner id: the server ends the call with the reason
    `grpc_common.ANOTHER_PROCESS` instead of `refused`, so the refused process knows the learner's checkpoint is not
    its own to write."""


def peer_host(peer: str) -> str:
    """A gRPC peer without its port ('ipv4:127.0.0.1:59704' -> 'ipv4:127.0.0.1'): each new connection of one
    client comes from another port."""
    host, _, port = peer.rpartition(":")
    return host if peer.startswith(("ipv4:", "ipv6:")) and port.isdigit() and ":" in host else peer


class SyncerHandler(Protocol):
    """What the server needs from the syncer service. Every method may block (the service's lock): the server
    calls them from its handler threads, never from its event loop."""

    def join(self, join: Join, diloco_config: dict, peer: str, session: str = "") -> Subscription | str | None:
        """A Subscription (whose first message is the Welcome), the refusal reason, or None when
        the syncer is shutting down (the learner retries later)."""
        ...

    def update(self, update: Update) -> tuple[bool, str, str]:
        """(accepted, reason, detail) of the syncer core."""
        ...

    def wire_model(self) -> WireModel | None:
        """What a well-formed update looks like, or None before the run has its genesis."""
        ...

    def genesis(self, genesis: Genesis, peer: str) -> tuple[bool, str]:
        """(accepted, detail): the proposed genesis became the run's global model, or why not."""
        ...

    def snapshot(self, after_round: int, not_before: float) -> tuple[int, Welcome] | str | None:
        """Without waiting: once more than `after_round` rounds have committed (at once when after_round is -1)
        and monotonic time `not_before` has come, (rounds committed, the whole global model); None while not;
        STOPPED when the syncer stops."""
        ...

    def is_member(self, learner_id: int) -> bool: ...

    def watch_refusal(self, declared: dict | None) -> str | None:
        """Why a watch whose evaluator declared the run config `declared` (None: it declared none) is refused."""
        ...

    def replaced(self, learner_id: int, session: str) -> str | None:
        """Why process `session` may no longer act for `learner_id` (another process joined as that learner after
        it), or None: it holds the id, or either side names no process."""
        ...

    def heartbeat(self, heartbeat: Heartbeat) -> bool: ...

    def leave(self, leave: Leave) -> None: ...

    def subscription_ended(self, subscription: Subscription) -> None: ...

    def status(self) -> dict: ...

    def record_rejection(self, reason: str, detail: str, *, learner_id: int | None, peer: str,
                         fragment: int | None = None, inner_step: int | None = None) -> None:
        """A refusal on the wire; `fragment` and `inner_step` come from the update's header once it
        has been checked (None before that, and for calls that are not updates)."""
        ...
