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

A command that stops by unwinding, as it does on Ctrl-C, stops the same way on SIGTERM and SIGHUP inside
`stop_signals_raise()`: each raises `Stopped`, a KeyboardInterrupt that names its signal, so that every `finally` on
the way runs (Python's default for SIGTERM ends the process at once, and a child it had SIGSTOPped stays stopped for
good). A cleanup that must not be cut by a second signal (lifting those SIGSTOPs) runs inside `deferred()`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

SIGNAL_CHECK_S = 0.2
"""The longest one wait of a main thread lasts before it looks at the signals due: how late a SIGTERM delivered to
another thread may be handled. Short against a person's patience, long against the cost of waking (a few wakeups a
second)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals besides SIGINT that ask a command to stop, as `ddiloco run` treats them."""

_received = False
"""A SIGINT arrived inside `watched()`: a plain flag, which a handler sets without a lock (`StopFlag`)."""
_deferred: list[int] | None = None
"""Inside `deferred()`: the signals that came meanwhile (raised at its end); None outside."""


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) raised where the main thread is, as SIGINT raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(interrupt: KeyboardInterrupt) -> signal.Signals:
    """The signal behind an interrupt: a `Stopped`'s own, else SIGINT."""
    return signal.Signals(interrupt.signum) if isinstance(interrupt, Stopped) else signal.SIGINT


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's convention for a command ended by a signal: 128 + its number (130 for Ctrl-C)."""
    return 128 + int(signal_of(interrupt))


def _interrupt(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def _on_sigint(signum: int, frame: object) -> None:
    global _received
    _received = True
    _raise(signum)


def _on_stop_signal(signum: int, frame: object) -> None:
    _raise(signum)


def _raise(signum: int) -> None:
    if _deferred is not None:
        _deferred.append(signum)
        return
    raise _interrupt(signum)


@contextlib.contextmanager
def watched() -> Iterator[None]:
    """Record every SIGINT inside (and still raise KeyboardInterrupt, as Python's own handler does); the handler that
    was there before comes back at the end. Only the main thread may install a handler: elsewhere (a command run
    in-process by a test's thread) this records nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _received
    _received = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        # The flag is this block's: left set, a command run in the same process after a Ctrl-C (a test's) read that
        # old Ctrl-C at its start and stopped at once (exit 130).
        _received = False


def raises_keyboard_interrupt(handler: object) -> bool:
    """Whether SIGINT's `handler` is Python's own, or `watched()`'s, which raises as Python's does: the handler a
    session may take a first Ctrl-C from (`ddiloco.session_lifecycle`)."""
    return handler is signal.default_int_handler or handler is _on_sigint


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise `Stopped` on the main thread; the handlers that were there before come back
    at the end. Elsewhere than on the main thread this changes nothing (only the main thread may install a
    handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _on_stop_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold back the interrupt of a signal that `watched()` or `stop_signals_raise()` handles until the end of the
    block, so that a cleanup runs whole; the first one held back is then raised, unless an exception (the first
    interrupt, typically) already leaves the block. Python's own SIGINT handler (outside `watched()`) still raises
    at once."""
    global _deferred
    if _deferred is not None:  # nested: the outer block raises
        yield
        return
    _deferred = []
    try:
        yield
    except BaseException:
        _deferred = None
        raise
    held, _deferred = _deferred, None
    if held:
        raise _interrupt(held[0])


def received() -> bool:
    """A SIGINT arrived inside `watched()`."""
    return _received


def wait_for(event: threading.Event | StopFlag) -> None:
    """`event.wait()` that lets this (main) thread run the signal handlers that fall due meanwhile."""
    while not event.wait(SIGNAL_CHECK_S):
        pass


def notify_if_free(cond: threading.Condition) -> None:
    """`cond.notify_all()` if its lock can be taken at once (or is this thread's: it should be reentrant); else
    nothing. What a signal handler may do to wake waiters (`StopFlag`): they look again at the end of their slice."""
    if cond.acquire(blocking=False):
        try:
            cond.notify_all()
        finally:
            cond.release()


class StopFlag:
    """A flag that turns true once, which a signal handler may set: `threading.Event`'s `set`, `is_set` and `wait`, but
    a `set()` that never waits for a lock.

    A handler runs on the main thread wherever that thread is, inside a lock's `acquire` too. `Event.set` takes the
    event's lock, which the main thread holds for a few bytecodes in every `Event.wait`; a SIGTERM handled there waits
    for that lock on the thread that holds it, for ever (and so does any other thread that sets the event after it).
    `set()` here sets the flag, then wakes the waiters only if it can take their lock at once (it is reentrant: a
    handler that interrupted a waiter on its own thread takes it); a waiter it could not wake sees the flag at the end
    of its current slice of `SIGNAL_CHECK_S`."""

    def __init__(self) -> None:
        self._set = False
        self._cond = threading.Condition(threading.RLock())

    def set(self) -> None:
        self._set = True
        notify_if_free(self._cond)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the flag is set, once it is or `timeout_s` passed (None: no bound)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._set:
                left = SIGNAL_CHECK_S if deadline is None else min(SIGNAL_CHECK_S, deadline - time.monotonic())
                if left <= 0:
                    break
                self._cond.wait(left)
        return self._set
