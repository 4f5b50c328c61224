"""A signal is never lost: a Ctrl-C that comes before a command has its own signal handling, and a SIGTERM that the
kernel hands to a thread other than the main one while the main thread waits.

Until a command installs its handlers (`ddiloco run`: the supervisor's stop; `ddiloco syncer`: its stop event), a
SIGINT raises KeyboardInterrupt wherever the main thread is, which `ddiloco.cli.main` turns into exit code 130. Most
of that time is spent importing torch and its dependencies, and an import that guards an optional module with a bare
`except:` swallows the KeyboardInterrupt with the ImportError it meant to catch: the command then started and ran to
its end (a CI run once saw `ddiloco run` train for 16 s after a Ctrl-C sent during its imports). `watched()`
also records the signal, so `received()` still says so after such a swallow, and the command stops before it starts.

Python runs a handler on the main thread only, once that thread runs bytecode again. The kernel delivers a signal
sent to the process to any thread that does not block it (after a SIGSTOP, to whichever wakes first on the SIGCONT),
often a gRPC thread, which only marks the handler due: a main thread blocked in a wait without a timeout then never
runs it (a syncer ran on forever after its SIGTERM). Every wait on a main thread that must notice a signal is cut
into slices of at most `SIGNAL_CHECK_S` (`wait_for`, and `LearnerIO`'s inbox).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNAL_CHECK_S = 0.2
"""The longest one wait of a main thread lasts before it looks at the signals due: how late a SIGTERM delivered to
another thread may be handled. Short against a person's patience, long against the cost of waking (a few wakeups a
second)."""

_received = threading.Event()


def _on_sigint(signum: int, frame: object) -> None:
    _received.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def watched() -> Iterator[None]:
    """Record every SIGINT inside (and still raise KeyboardInterrupt, as Python's own handler does); the handler that
    was there before comes back at the end. Only the main thread may install a handler: elsewhere (a command run
    in-process by a test's thread) this records nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def received() -> bool:
    """A SIGINT arrived inside `watched()`."""
    return _received.is_set()


def wait_for(event: threading.Event) -> None:
    """`event.wait()` that lets this (main) thread run the signal handlers that fall due meanwhile."""
    while not event.wait(SIGNAL_CHECK_S):
        pass
