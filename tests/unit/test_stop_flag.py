"""`interrupts.StopFlag` and the learner inbox's `wake`: what a signal handler calls to stop a wait never waits for a
lock, since the handler may run on the very thread that holds it (a learner hung so for good after a SIGTERM)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from ddiloco.interrupts import SIGNAL_CHECK_S, StopFlag
from ddiloco.transport.learner_io import Inbox

WAIT_S = 30.0


def holding(lock) -> tuple[threading.Event, threading.Event]:
    """Another thread takes `lock` and holds it until the second event is set; the first is set once it holds it."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait(WAIT_S)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(WAIT_S)
    return held, release


def test_a_stop_flag_is_an_event_that_turns_true_once():
    flag = StopFlag()
    assert not flag.is_set()
    started = time.monotonic()
    assert flag.wait(0.05) is False
    assert time.monotonic() - started >= 0.05
    flag.set()
    assert flag.is_set() and flag.wait(0) is True and flag.wait() is True


def test_set_returns_at_once_while_another_thread_holds_the_lock_and_a_waiter_still_sees_it():
    flag = StopFlag()
    seen = threading.Event()
    threading.Thread(target=lambda: flag.wait(WAIT_S) and seen.set(), daemon=True).start()
    _, release = holding(flag._cond)
    started = time.monotonic()
    flag.set()
    assert time.monotonic() - started < 1.0  # threading.Event.set would wait for the holder
    release.set()
    assert seen.wait(WAIT_S)


def test_set_from_the_thread_that_holds_the_lock_returns():
    # What a signal handler does when it interrupts the waiter on its own thread.
    flag = StopFlag()
    with flag._cond:
        flag.set()
    assert flag.wait(0)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_signal_handler_that_sets_the_flag_ends_a_wait_on_the_main_thread():
    flag = StopFlag()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: flag.set())
    try:
        main = threading.main_thread().ident
        timer = threading.Timer(0.2, signal.pthread_kill, args=(main, signal.SIGUSR1))
        timer.start()
        started = time.monotonic()
        assert flag.wait(WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_an_inbox_wake_returns_at_once_while_another_thread_holds_its_lock_and_ends_the_wait():
    inbox = Inbox()
    ended = threading.Event()
    threading.Thread(target=lambda: (inbox.wait(None), ended.set()), daemon=True).start()
    time.sleep(SIGNAL_CHECK_S)  # the waiter is inside its wait (not required: a wake before it is kept)
    _, release = holding(inbox._cond)
    started = time.monotonic()
    inbox.wake()
    assert time.monotonic() - started < 1.0
    release.set()
    assert ended.wait(WAIT_S)


def test_a_ctrl_c_inside_watched_is_forgotten_at_its_end():
    # Left set, a command run in the same process later (`run_commands.run` from a test) read that old Ctrl-C at its
    # start and stopped at once, exit 130: tests/unit/test_child_environments.py after test_chaos_stops.py's Ctrl-C.
    from ddiloco import interrupts

    with pytest.raises(KeyboardInterrupt), interrupts.watched():
        signal.raise_signal(signal.SIGINT)
    assert not interrupts.received()
