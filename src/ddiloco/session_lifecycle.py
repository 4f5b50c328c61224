"""The lifecycle every session object shares: rank 0's `Session` and the other ranks' `FollowerSession`.

Owns the `with` block (`__enter__` starts, `__exit__` closes, `failed` when the block raised), the rules that a
session starts once and that a process holds one open session per learner (a second one inside the first joined as
a second learner of the same id, which the syncer refused as a duplicate process), what the process's signals and
its launcher do while a session runs, and the check of each `step()` call (inside the session, within the run's
inner-step budget, `tokens` an integer >= 0). What starting, stepping, stopping and closing do is each session's own.

Signals. SIGTERM is turned into `request_stop()` while the session runs: `done` turns true after the current step,
the session checkpoints and leaves. So is SIGHUP where it has Python's default (a closed terminal ended a learner run
by hand without a checkpoint); a SIGHUP handler of the user's, or nohup's SIG_IGN, stays as it is. So is a first
SIGINT (Ctrl-C) where it has Python's default, which raised KeyboardInterrupt wherever the loop was (a learner run by
hand was `failed`, without its checkpoint at the stop); a second one raises KeyboardInterrupt as Python does. Python
runs handlers on the main thread only, so the handler is installed only there; a session on another thread says once, at
its start, that a SIGTERM cannot stop it cleanly and what to do.
A handler of the user's own installed before the session (a SLURM requeue handler) still runs: once, with the
signal's number and frame, after the session has checkpointed and left, and it is back in place from then on.
SIGCHLD's Python handler (torch's DataLoader installs one that raises once a worker process died) is held off from a
stop signal, and while the session closes, to the session's end: `scancel` and systemd's stop send SIGTERM to every
process of the job, the DataLoader's workers die of theirs, and the handler raised wherever the learner was, its close
included (it lost its checkpoint at the stop). The DataLoader still says that its workers are gone at the next batch
asked of it.

The launcher. A process that `ddiloco run` started names it in its environment (`ddiloco.environment()`); the
session watches it (`ddiloco.launcher_watch`) and, once it is gone, stops as on SIGTERM, on any thread, the user's
handler included (a script behind a wrapper gets no SIGTERM from the kernel when the launcher dies).
"""

from __future__ import annotations

import gc
import logging
import numbers
import signal
import threading
import weakref
from pathlib import Path
from typing import Any, Self

import torch

from ddiloco import interrupts, rank_failures
from ddiloco.checks import invalid
from ddiloco.environment import environment
from ddiloco.launcher_watch import LauncherWatch, watch_launcher
from ddiloco.learner_group import RanksOutOfStepError

logger = logging.getLogger(__name__)

_open_sessions: weakref.WeakValueDictionary[tuple[Any, ...], SessionLifecycle] = weakref.WeakValueDictionary()
"""The sessions open in this process, by `SessionLifecycle._key()`. Process-wide by nature: what it guards against is
two sessions of one learner in one process. Weak: a session nothing refers to any more (an in-process one a notebook
cell started and a Ctrl-C kept from its close) is no longer open to anyone, and is let go. Held strongly, every such
session, its model and optimizer would be kept for the life of the process (a probe: 223 -> 687 MB over three
interrupted re-runs), and the re-run's session of the same learner would be refused."""
_open_lock = threading.Lock()


class SessionLifecycle:
    """Base of the session objects that `ddiloco.session()` returns. Subclasses implement `_open()` (what
    `start()` does once the session is entered), `request_stop()` (safe from a signal handler and from any thread) and
    `close(failed=...)`, which ends with `_end()`, and have `learner_id`, `inner_step` and `inner_steps` (the learner's
    inner steps so far and the run's budget)."""

    learner_id: int
    inner_step: int
    inner_steps: int

    def __init__(self, *, handle_sigterm: bool) -> None:
        self._handle_sigterm = handle_sigterm
        self._previous_handler: Any = None
        """SIGTERM's handler from before the session (None: one Python did not install)."""
        self._sigterm_installed = False
        self._sighup_installed = False
        """Whether the session took SIGHUP, which had Python's default (`_take_sigterm`)."""
        self._sigint_previous: Any = None
        """SIGINT's handler from before the session, where it raised KeyboardInterrupt and the session took SIGINT
        (`_take_sigint`); None where it did not."""
        self._sigchld_previous: Any = None
        """SIGCHLD's Python handler, held off from a stop signal or the close to the session's end (`_hold_sigchld`)."""
        self._deferred_signal: tuple[int, Any] | None = None
        """(signum, frame) of the first SIGTERM the session took, for the user's handler from before it."""
        self._launcher_watch: LauncherWatch | None = None
        self._rank_failures: Path | None = None
        """Where an exception that leaves the session is recorded (in a rank group; `ddiloco.rank_failures`)."""
        self._rank = 0
        self._entered = False
        self._closed = False
        self._over = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # `sys.exit(0)` inside the block is a loop that ended early, as a `break` is: not a failure. Ending the session
        # `failed` would leave its last work never sent (a probe: 3 rounds committed where a `break` made 7).
        failed = exc_type is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))
        if failed:
            # First, before closing does anything another rank could notice (`ddiloco.rank_failures`).
            rank_failures.record(self._rank_failures, self._rank, explains=isinstance(exc, RanksOutOfStepError))
        self._hold_sigchld()
        try:
            self.close(failed=failed)
        except BaseException as failure:
            if exc_type is None:  # the close failed (ranks that left their loops apart): recorded the same way
                rank_failures.record(self._rank_failures, self._rank,
                                     explains=isinstance(failure, RanksOutOfStepError))
            raise
        finally:
            self._end()

    def start(self) -> None:
        """Enter the session (once); what that does is the subclass's `_open()`."""
        if self._entered or self._over:
            raise RuntimeError("a session is started once" + ("" if self._entered else ", and this one was closed "
                                                              "first: make a new ddiloco.session(...)"))
        try:
            self._claim()
        except BaseException:
            self._end()  # what the session holds from its making goes (`_release`)
            raise
        self._entered = True
        try:
            self._take_sigterm()
            env = environment()
            self._rank_failures, self._rank = env.rank_failures, env.rank
            self._launcher_watch = watch_launcher(env.launcher, name=f"learner {self.learner_id}",
                                                  on_gone=self._on_launcher_gone)
            self._open()
            self._take_sigint()
        except BaseException:
            self._end()
            raise

    def _key(self) -> tuple[Any, ...]:
        """What two sessions of one learner share: the learner id (and, for `Session`, the syncer or hub)."""
        return type(self).__name__, self.learner_id

    def _claim(self) -> None:
        """RuntimeError when a session of the same learner is open in this process already."""
        with _open_lock:
            other = _open_sessions.setdefault(self._key(), self)
        if other is not self:
            del other
            gc.collect()  # a session nothing refers to but its own reference cycles is gone only once collected
            with _open_lock:
                other = _open_sessions.setdefault(self._key(), self)
        if other is not self:
            raise RuntimeError(f"a second ddiloco.session(...) of learner {self.learner_id} while the first is still "
                               "open in this process: a process is one learner, with one session at a time. End the "
                               "first `with ddiloco.session(...)` block, or call the first session's close(), before "
                               "opening another (one after the other, each resumes where the last one stopped)")

    def _take_sigterm(self) -> None:
        """SIGTERM -> `request_stop()`, on the main thread; elsewhere, say once what that means."""
        if not self._handle_sigterm:
            return
        thread = threading.current_thread()
        if thread is not threading.main_thread():
            logger.warning("[learner %d] ddiloco.session runs on thread %r, not the main thread: Python runs signal "
                           "handlers on the main thread only, so a SIGTERM (ddiloco run's Ctrl-C, a scheduler's "
                           "preemption) ends this process without a checkpoint or a Leave (a restart resumes from the "
                           "last periodic checkpoint). Run the training loop on the main thread, or have the main "
                           "thread's SIGTERM handler call sync.request_stop()", self.learner_id, thread.name)
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
            # A closed terminal (an ssh session gone) stops a learner started by hand as ddiloco run's stop does, with a
            # checkpoint; Python's default ended it where it was. A handler of the user's, or nohup's SIG_IGN, stays.
            signal.signal(signal.SIGHUP, self._on_sighup)
            self._sighup_installed = True

    def _take_sigint(self) -> None:
        """A first Ctrl-C -> `request_stop()` once the session has started (one while it joins still interrupts the
        start), where SIGINT raises KeyboardInterrupt (Python's handler, or `ddiloco.interrupts`'), on the main
        thread."""
        if (self._handle_sigterm and threading.current_thread() is threading.main_thread()
                and interrupts.raises_keyboard_interrupt(signal.getsignal(signal.SIGINT))):
            self._sigint_previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _hold_sigchld(self) -> None:
        """SIGCHLD without its Python handler until `_end` (see the module docstring), on the main thread."""
        if self._sigchld_previous is not None or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGCHLD)
        if callable(handler):
            self._sigchld_previous = handler
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def _on_sighup(self, signum: int, frame: Any) -> None:
        self._hold_sigchld()
        self.request_stop()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """A first Ctrl-C: the clean stop; the handler from before (a KeyboardInterrupt) from the second on."""
        previous, self._sigint_previous = self._sigint_previous, None
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        logger.warning("[learner %d] Ctrl-C: stopping after this inner step, with a checkpoint (Ctrl-C again to "
                       "interrupt at once)", self.learner_id)
        self.request_stop()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # The session's clean stop first; the user's own handler waits for the end of the session (`_end`).
        self._hold_sigchld()
        self.request_stop()
        if self._deferred_signal is None and callable(self._previous_handler):
            self._deferred_signal = (signum, frame)

    def _on_launcher_gone(self) -> None:
        """What the kernel's SIGTERM does to the launcher's direct children, for a process behind a wrapper too: the
        session's stop and, where the session took SIGTERM, the user's own handler from before it once the session has
        ended (called with no frame)."""
        if self._sigterm_installed:
            self._on_sigterm(signal.SIGTERM, None)
        else:
            self.request_stop()

    def _open(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Let go of what the session holds from its making (threads, open files), if its close has not: a session
        made and never started, or refused at its start. Idempotent; nothing by default."""

    def request_stop(self) -> None:
        raise NotImplementedError

    def close(self, *, failed: bool = False) -> None:
        raise NotImplementedError

    def _check_step(self, tokens: int) -> int:
        """`tokens` as an int, once `step(tokens)` is known to be called inside the session, within the run's budget,
        with a valid token count. Any integer counts (numpy's too: `np.int64(len(batch))`); a bool does not."""
        if not self._entered or self._closed:
            raise RuntimeError("sync.step() outside the session: call it inside `with ddiloco.session(...)`")
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
            hint = " (a tensor: pass int(t))" if isinstance(tokens, torch.Tensor) else ""
            raise invalid("tokens", tokens, f"an int >= 0 (tokens or samples in this step){hint}")
        if self.inner_step >= self.inner_steps:
            # `done` turned true at the budget: a step past it comes from a loop that does not check `done`.
            raise RuntimeError(f"sync.step() after the run's budget of {self.inner_steps} inner steps: sync.done is "
                               "true from there on; end the loop with `while not sync.done`")
        return int(tokens)

    def _restore_sigterm(self) -> None:
        """The SIGTERM handler from before the session, back in place (Python's default where the one before was not
        Python's to give back), and those of SIGHUP, SIGINT and SIGCHLD that the session took or held off; each only
        while the session's own is in place. A handler the user's code set during the session (a preemption library set
        up lazily inside the loop) stays: put back at the session's end, the one from before would replace it."""
        if self._sigterm_installed:
            self._sigterm_installed = False
            previous = self._previous_handler
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if self._sighup_installed:
            self._sighup_installed = False
            if signal.getsignal(signal.SIGHUP) == self._on_sighup:
                signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if self._sigint_previous is not None:
            previous, self._sigint_previous = self._sigint_previous, None
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, previous)
        if self._sigchld_previous is not None:
            previous, self._sigchld_previous = self._sigchld_previous, None
            if signal.getsignal(signal.SIGCHLD) is signal.SIG_DFL:  # not one set since, by the user's code
                signal.signal(signal.SIGCHLD, previous)

    def _end(self) -> None:
        """The session is over (closed, or its start failed): it is no longer open in this process, its launcher
        no longer watched, SIGTERM's handler from before it back in place and, if a SIGTERM came meanwhile, called
        now, once. Idempotent."""
        if self._over:
            return
        self._over = True
        with _open_lock:
            if _open_sessions.get(self._key()) is self:
                del _open_sessions[self._key()]
        if self._launcher_watch is not None:
            self._launcher_watch.stop()
        self._release()
        self._restore_sigterm()
        deferred, self._deferred_signal = self._deferred_signal, None
        if deferred is not None:
            self._previous_handler(*deferred)
