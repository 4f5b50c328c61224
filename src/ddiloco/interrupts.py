"""A Ctrl-C that comes before a command has its own signal handling is never lost.

Until a command installs its handlers (`ddiloco run`: the supervisor's stop; `ddiloco syncer`: its stop event), a
SIGINT raises KeyboardInterrupt wherever the main thread is, which `ddiloco.cli.main` turns into exit code 130. Most
of that time is spent importing torch and its dependencies, and an import that guards an optional module with a bare
`except:` swallows the KeyboardInterrupt with the ImportError it meant to catch: the command then started and ran to
its end (a CI run once saw `ddiloco run` train for 16 s after a Ctrl-C sent during its imports). `watched()`
also records the signal, so `received()` still says so after such a swallow, and the command stops before it starts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

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
