"""Simulated network links: latency plus bytes / bandwidth, one first-in-first-out pipe per direction.

Owns how many bytes a message counts for; how long it takes to cross is `ddiloco.link_model`'s, the model
the runtime's link emulation shares, here on the virtual clock. A link sends one message at a time: a
message starts when the previous one on the same link has left (so a burst of fragments queues, and peak
bandwidth matters), takes nbytes * 8 / bandwidth_bps to leave, and arrives latency_s later. Messages on one
link therefore arrive in the order they were sent, as on a TCP or gRPC stream. Each learner has its own
uplink (learner -> syncer) and downlink (syncer -> learner); the syncer's side is not a bottleneck (the
paper's syncer is a CPU service with a fat pipe).

Sizes: tensor payloads count their exact bytes (`Update.payload_bytes`: the codec's bytes;
`FragmentState.payload_bytes`: float32; `FragmentDelta.payload_bytes`: the downlink codec's bytes); every
message adds `MESSAGE_HEADER_BYTES` for its envelope (ids, versions, counters, tensor names), so heartbeats
and joins are not free but are small.
"""

from __future__ import annotations

from typing import Any

from ddiloco.link_model import BITS_PER_BYTE, LinkConfig, SerialPipe
from ddiloco.messages import FragmentDelta, FragmentState, Rejected, Update, Welcome

MESSAGE_HEADER_BYTES = 256
"""Envelope of every message: ids, versions, counters and the tensor names of a small model."""

def payload_nbytes(message: object) -> int:
    """Tensor bytes a message carries (0 for control messages)."""
    if isinstance(message, Update | FragmentState | FragmentDelta):
        return message.payload_bytes
    if isinstance(message, Welcome):
        return sum(state.payload_bytes for state in message.fragments)
    return 0


def message_nbytes(message: object) -> int:
    """Bytes a message occupies on the wire: its payload plus the envelope."""
    return payload_nbytes(message) + MESSAGE_HEADER_BYTES


def describe_message(message: object) -> dict[str, Any]:
    """A message as a small JSON-ready dict for an event log (no tensors)."""
    if isinstance(message, Update):
        return {"type": "Update", "fragment": message.fragment, "base_version": message.base_version,
                "inner_step": message.inner_step, "steps": message.steps, "tokens": message.tokens}
    if isinstance(message, FragmentState):
        return {"type": "FragmentState", "fragment": message.fragment, "version": message.version}
    if isinstance(message, FragmentDelta):
        return {"type": "FragmentDelta", "fragment": message.fragment, "version": message.version,
                "base_version": message.base_version}
    if isinstance(message, Welcome):
        return {"type": "Welcome", "versions": [s.version for s in message.fragments]}
    if isinstance(message, Rejected):
        return {"type": "Rejected", "fragment": message.fragment, "reason": str(message.reason)}
    return {"type": type(message).__name__}


class Link:
    """A `ddiloco.link_model.SerialPipe` then the latency, in virtual time; counts the bytes and messages it
    carried."""

    def __init__(self, config: LinkConfig) -> None:
        self.config = config
        self._pipe = SerialPipe()
        self.bytes_sent = 0
        self.messages_sent = 0

    def send(self, now: float, nbytes: int) -> float:
        """Start sending `nbytes` at `now` (or when the link is free); returns the arrival time."""
        left_at = self._pipe.send(now, self.config.transfer_s(nbytes))
        self.bytes_sent += nbytes
        self.messages_sent += 1
        return left_at + self.config.latency_s

    def reset(self, now: float) -> None:
        """The endpoint died: whatever was queued is gone, the link is idle from `now`."""
        self._pipe.reset(now)


__all__ = ["BITS_PER_BYTE", "MESSAGE_HEADER_BYTES", "Link", "LinkConfig", "describe_message", "message_nbytes",
           "payload_nbytes"]
