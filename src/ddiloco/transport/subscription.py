"""A learner's downlink queue on the syncer: the messages the service sends it, bounded, until closed.

The syncer service puts messages (any thread, under its lock); the server's stream for that learner takes them
(on its event loop, `next`) and sends them. See `Subscription` for the bounds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.messages import FragmentDelta, FragmentState, Rejected, SyncerMessage

DELTAS_PENDING_PER_FRAGMENT = 4
"""A subscriber this many changes of one fragment behind gets the fragment's newest full state instead of
more changes: an int8 change is a quarter of the float32 state, so collapsing never sends more bytes."""
OTHERS_PENDING = 64
"""Rejections (and other small messages) kept for a subscriber that does not read; older ones are dropped."""


@dataclass(frozen=True)
class _Newest:
    """Stands in a subscription for a fragment's newest state, taken when it is sent."""

    fragment: int


class Subscription:
    """One learner's downlink: the messages the syncer sends it, in order, until closed. Bounded: a
    subscriber that does not keep up holds at most one pending state per fragment (a newer state replaces an
    unsent one; past DELTAS_PENDING_PER_FRAGMENT changes, the fragment's newest state is sent instead, taken
    from `newest` when its turn comes) and the last OTHERS_PENDING other messages, so a learner that never
    reads cannot grow the syncer's memory. `put` and `close` may be called from any thread; one consumer
    reads with `next` (asyncio) or `take`."""

    def __init__(self, learner_id: int, *,
                 on_delivered: Callable[[FragmentState | FragmentDelta, float], None] | None = None,
                 newest: Callable[[int], FragmentState] | None = None, session: str = "", peer: str = "",
                 since: float = 0.0) -> None:
        """`session`, `peer`, `since`: the joining process, its address and when it joined (for messages)."""
        self.learner_id = learner_id
        self.session, self.peer, self.since = session, peer, since
        self._on_delivered = on_delivered
        self._newest = newest
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[float, SyncerMessage | _Newest]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self.closed = False
        self.collapsed = 0
        """Fragment messages replaced by a newer state of their fragment."""

    def put(self, message: SyncerMessage) -> None:
        with self._lock:
            if self.closed:
                return
            if isinstance(message, FragmentState | FragmentDelta):
                self._put_fragment(message)
            else:
                others = [i for i, (_, m) in enumerate(self._pending) if isinstance(m, Rejected)]
                if len(others) >= OTHERS_PENDING:
                    del self._pending[others[0]]
                self._pending.append((time.monotonic(), message))
        self._wake()

    def _put_fragment(self, message: FragmentState | FragmentDelta) -> None:
        p = message.fragment
        same = [i for i, (_, m) in enumerate(self._pending)
                if isinstance(m, FragmentState | FragmentDelta | _Newest) and m.fragment == p]
        if same and isinstance(self._pending[same[-1]][1], _Newest):
            return  # the newest state, taken when sent, includes this change
        if same and (isinstance(message, FragmentState) or len(same) >= DELTAS_PENDING_PER_FRAGMENT):
            replacement = message if isinstance(message, FragmentState) or self._newest is None else _Newest(p)
            queued_at = self._pending[same[0]][0]
            for i in reversed(same):
                del self._pending[i]
            self.collapsed += len(same)
            self._pending.insert(same[0], (queued_at, replacement))
            return
        self._pending.append((time.monotonic(), message))

    def close(self) -> None:
        """No more messages: the consumer gets those still pending, then the end."""
        with self._lock:
            self.closed = True
        self._wake()

    def discard(self) -> None:
        """The consumer has gone: close, and free what it will never read."""
        with self._lock:
            self.closed = True
            self._pending.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def take(self) -> tuple[float, SyncerMessage | _Newest] | None:
        """The next (queued_at, message) without waiting, or None."""
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def resolve(self, message: SyncerMessage | _Newest) -> SyncerMessage:
        """A taken message as it is sent (a stand-in becomes the fragment's newest state; may block on the
        syncer's lock: call it off the event loop)."""
        if isinstance(message, _Newest):
            assert self._newest is not None
            return self._newest(message.fragment)
        return message

    def delivered(self, message: SyncerMessage, queued_at: float) -> None:
        if isinstance(message, FragmentState | FragmentDelta) and self._on_delivered is not None:
            # The last chunk has been handed to gRPC's flow control: the sync time the adaptive grace window
            # estimates (commit -> fragment on its way to the learner).
            self._on_delivered(message, time.monotonic() - queued_at)

    async def next(self) -> tuple[float, SyncerMessage | _Newest] | None:
        """Waits (on the event loop) for the next message; None once closed."""
        if self._loop is None:
            self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
        assert self._ready is not None
        while True:
            self._ready.clear()
            item = self.take()
            if item is not None:
                return item
            if self.closed:
                return None
            await self._ready.wait()

    def _wake(self) -> None:
        loop, ready = self._loop, self._ready
        if loop is not None and ready is not None:
            with contextlib.suppress(RuntimeError):  # the server's loop has stopped: nobody is waiting any more
                loop.call_soon_threadsafe(ready.set)
