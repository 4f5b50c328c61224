"""Each broadcast encoded once and shared by every subscription that sends it.

A round's new fragment (a `FragmentState`, or a `FragmentDelta` with a lossy downlink) is one object that the
syncer service puts in every live learner's `Subscription`; before, each subscriber's stream encoded it again
(the CRC32 of all its bytes and a copy into chunks, per subscriber). `SharedChunks` keys the encoded chunks by
the message object: the first stream to send it starts the encoding (in a task of its own, so a subscriber
that goes away meanwhile does not cancel it for the others), later ones wait for the same result, and the
entry is dropped when the message itself is freed (the last subscription has sent it). Only the event loop
touches the table; the drop may run on any thread, and a dict's `pop` is atomic.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable

from ddiloco.messages import FragmentDelta, FragmentState
from ddiloco.transport import wire_pb2

Chunks = list[wire_pb2.SyncerChunk]


class SharedChunks:
    """Encoded chunks per broadcast message, for as long as the message lives. See the module docstring."""

    def __init__(self, encode: Callable[[FragmentState | FragmentDelta], Awaitable[Chunks]]) -> None:
        """`encode`: the chunks of one message (a coroutine: it may hand the work to a thread)."""
        self._encode = encode
        self._tasks: dict[int, asyncio.Task[Chunks]] = {}
        self.encoded = 0
        """Messages encoded so far (each once, however many subscriptions sent it)."""

    async def chunks(self, message: FragmentState | FragmentDelta) -> Chunks:
        key = id(message)
        task = self._tasks.get(key)
        if task is None:
            task = asyncio.ensure_future(self._encode(message))
            self._tasks[key] = task
            self.encoded += 1
            # Dropped when the message is freed, before its id can belong to another object.
            weakref.finalize(message, self._tasks.pop, key, None)
        return await asyncio.shield(task)

    def __len__(self) -> int:
        return len(self._tasks)
