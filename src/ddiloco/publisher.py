"""A publish that does not stall training: the pseudo-gradient is taken and encoded on a background thread.

At a publish the training thread only copies the fragment (`FragmentAccess.read`: a float32 copy on the
parameter's device, or, for a sharded learner, the gathered full value) and queues the update; the
publisher's thread then computes base - copy (on the parameter's device), checks it is finite, encodes it
with the run's codec and hands the update to the transport. The block codecs (int8, int4) quantise on the
parameter's device and copy only scales and codes to the host; the others copy the float values first.
Every message the session sends goes through the same FIFO queue, so the syncer sees them in the order
the session made them.

An update whose pseudo-gradient turns out not to be finite is withheld here, not sent: the session hears
of it at its next call (`take_withheld`) and the learner forgets that publish (`Learner.withdraw`), exactly
as if it had been withheld on the spot. The queue is bounded (`MAX_QUEUED`): a learner that publishes
faster than one thread can encode waits for the encoder instead of piling up copies of its fragments.

On a GPU the training thread does not wait for the device either: the copy is queued on the training stream,
followed by an event (`DeviceOrder`); the publisher's thread makes its own side stream wait for that event,
computes and quantises the pseudo-gradient there and copies the codes into pinned host memory without blocking
(`ddiloco.compression.to_host`), then waits for its own stream only. The training stream never waits for the
side stream, and the side stream never waits for inner steps queued after the copy. On the CPU all of this is
skipped: the values are already where they are encoded.

Only the gRPC transport uses it; in process (`InProcessHub`) delivery stays synchronous and deterministic.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ddiloco.codec_interface import Codec
from ddiloco.messages import LearnerMessage, Update

logger = logging.getLogger(__name__)

MAX_QUEUED = 4
"""Messages waiting for the publisher's thread before the training thread waits for it: a few fragments'
copies of memory at most."""


class DeviceOrder:
    """Where a snapshot's copy stands on a GPU: an event recorded on the training thread's stream right after the
    copy was queued. `side_stream()` is a context in which the caller's work runs on a stream of its own that
    first waits for that event: it sees the finished copy and nothing queued after it. On the CPU both are
    no-ops (`SAME_STREAM`)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self._event = None
        if device is not None:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))  # the training stream: after the copy

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> DeviceOrder:
        """A side stream when the tensors are on one GPU; otherwise (the CPU; a fragment spread over several
        devices, rare) the work stays on the current streams, in order behind the copy."""
        devices = {t.device for t in tensors.values()}
        device = devices.pop() if len(devices) == 1 else None
        return DeviceOrder(device) if device is not None and device.type == "cuda" else SAME_STREAM

    def side_stream(self, streams: dict[torch.device, object]) -> contextlib.AbstractContextManager:
        """Run on the side stream of this order's device (one per device, kept in `streams`), after the copy."""
        if self._event is None:
            return contextlib.nullcontext()
        stream = streams.get(self.device)
        if stream is None:
            stream = streams[self.device] = torch.cuda.Stream(self.device)
        stream.wait_event(self._event)
        return torch.cuda.stream(stream)


SAME_STREAM = DeviceOrder(None)


def pseudo_gradient(base: torch.Tensor, current: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`base - current`: the exact float32 global value less the parameter's (a float32 copy), for a parameter of
    `dtype`. One held in a narrower dtype (bf16, fp16) is measured from the global value as it holds it, rounded to that
    dtype: what it trained, not the rounding of the global value (a frozen bf16 parameter sends zeros, as a float32 one
    does). Measured from the float32 value, that rounding would go with every update: frozen bf16 weights would drift by
    a bf16 step, and every update would carry its noise."""
    if torch.finfo(dtype).bits < torch.finfo(base.dtype).bits:
        base = base.to(dtype).to(base.dtype)
    return base - current


class DeferredPayload(Mapping[str, bytes]):
    """An update's payload, computed on first use: base - snapshot per tensor, encoded. `None` from `resolve`
    when a pseudo-gradient is not finite (the update must then be withheld)."""

    def __init__(self, base: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor], codec: Codec, *,
                 dtypes: Mapping[str, torch.dtype]) -> None:
        """`dtypes`: each parameter's own dtype (`pseudo_gradient`)."""
        self._base = dict(base)  # the fragment's base tensors are replaced on a new version, never changed in place
        self._dtypes = dtypes
        self._snapshot = dict(snapshot)
        self._order = DeviceOrder.of(self._snapshot)
        self._codec = codec
        self._encoded: dict[str, bytes] | None = None
        self.non_finite: str | None = None
        """The first tensor whose pseudo-gradient is not finite, once resolved."""
        self._lock = threading.Lock()

    @torch.no_grad()
    def resolve(self, streams: dict[torch.device, object] | None = None) -> dict[str, bytes] | None:
        """Encode (once). `streams`: the caller's side streams, one per GPU (a private one otherwise)."""
        with self._lock:
            if self._encoded is None and self.non_finite is None:
                encoded = {}
                # Every tensor used on the side stream stays referenced here until its work is over: the
                # finiteness check and the codec's copy to the host wait for that stream.
                with self._order.side_stream({} if streams is None else streams):
                    for name, snapshot in self._snapshot.items():
                        delta = pseudo_gradient(self._base[name], snapshot, self._dtypes[name])  # on its device
                        if not bool(torch.isfinite(delta).all()):
                            self.non_finite = name
                            break
                        encoded[name] = self._codec.encode(delta)
                    else:
                        self._encoded = encoded
                self._snapshot = {}  # the copies go as soon as they are encoded
            return self._encoded

    def _resolved(self) -> dict[str, bytes]:
        encoded = self.resolve()
        if encoded is None:
            raise ValueError(f"the pseudo-gradient of {self.non_finite} is not finite: this update is withheld")
        return encoded

    def __getitem__(self, name: str) -> bytes:
        return self._resolved()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())


@dataclass(frozen=True)
class Withheld:
    """A queued update that was not sent: its pseudo-gradient of `tensor` is not finite."""

    update: Update
    tensor: str


_DRAINED = object()


class Publisher:
    """One thread between the session and its transport. See the module docstring."""

    def __init__(self, send: Callable[[LearnerMessage], None], *, on_sent: Callable[[Update], None],
                 on_dropped: Callable[[Update, str], None] = lambda update, reason: None,
                 on_withheld: Callable[[], None] = lambda: None) -> None:
        """`send`: the transport's; `on_sent(update)`: an update's bytes are known (the learner counts them);
        `on_dropped(update, reason)`: an update still queued when the publisher closed, never sent; `on_withheld()`:
        an update was withheld (`take_withheld` has it): the training thread, if it waits for that update's round,
        must take it now (the transport's `wake`), or it waited out `max_wait_s` (60 s) for a round never to come."""
        self._send = send
        self._on_sent = on_sent
        self._on_dropped = on_dropped
        self._on_withheld = on_withheld
        self._closed = False
        self._send_lock = threading.Lock()
        """Held while handing a message to the transport: after `close` returns, nothing more is sent."""
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        self._withheld: list[Withheld] = []
        self._withheld_lock = threading.Lock()
        self.failure: Exception | None = None
        """What failed on this thread while it computed an update (`raise_failure`)."""
        self._streams: dict[torch.device, object] = {}
        """This thread's side stream per GPU (`DeviceOrder`); empty on the CPU."""
        self._thread = threading.Thread(target=self._loop, name="learner-publish", daemon=True)
        self._thread.start()

    def send(self, message: LearnerMessage) -> None:
        self._queue.put(message)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every message queued so far is with the transport; False on timeout."""
        done = threading.Event()
        self._queue.put((_DRAINED, done))
        return done.wait(timeout_s)

    def raise_failure(self) -> None:
        """Raise, on the caller's (the training) thread, what failed on this one while computing an update: this
        thread goes on (nothing queued waits for ever), dropping every update, so the learner must stop."""
        if self.failure is not None:
            raise RuntimeError(f"an update could not be computed on the publisher's thread: {self.failure!r}") \
                from self.failure

    def take_withheld(self) -> list[Withheld]:
        with self._withheld_lock:
            withheld, self._withheld = self._withheld, []
        return withheld

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float) -> None:
        """Hand what is queued to the transport (waiting up to `timeout_s`); what is left after that is dropped
        (reason "exit"), since the transport closes next."""
        self.drain(timeout_s)
        with self._send_lock:
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, tuple) and item[0] is _DRAINED:
                item[1].set()
                continue
            deferred = isinstance(item, Update) and isinstance(item.payload, DeferredPayload)
            if isinstance(item, Update) and self.failure is not None:
                self._on_dropped(item, "failed")
                continue
            try:
                resolved = item.payload.resolve(self._streams) if deferred else None
            except Exception as exc:  # noqa: BLE001 - the training thread raises it (`raise_failure`)
                logger.exception("[learner %d | inner %d] the update of fragment %d could not be computed",
                                 item.learner_id, item.inner_step, item.fragment)
                self.failure = exc
                self._on_dropped(item, "failed")
                continue
            if deferred and resolved is None:
                logger.error("[learner %d | inner %d] non-finite pseudo-gradient in %s: update withheld",
                             item.learner_id, item.inner_step, item.payload.non_finite)
                with self._withheld_lock:
                    self._withheld.append(Withheld(item, item.payload.non_finite or "?"))
                self._on_withheld()
                continue
            with self._send_lock:
                if self._closed:
                    if isinstance(item, Update):
                        self._on_dropped(item, "exit")
                    continue
                if deferred:
                    self._on_sent(item)
                try:
                    self._send(item)
                except Exception:  # the transport's own faults are state; anything else must not kill this thread
                    logger.exception("[publisher] sending %s failed", type(item).__name__)
