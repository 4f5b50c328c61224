"""The lifecycle every session object shares: rank 0's `Session` and the other ranks' `FollowerSession`.

Owns the `with` block (`__enter__` starts, `__exit__` closes, `failed` when the block raised), the rule that
a session starts once, SIGTERM turned into `request_stop()` while the session runs (installed only on the
main thread, where Python delivers signals; the previous handler restored when the session ends), and the
check of each `step()` call (inside the session, within the run's inner-step budget, `tokens` an integer >= 0).
What starting, stepping, stopping and closing do is each session's own.
"""

from __future__ import annotations

import numbers
import signal
import threading
from typing import Any, Self

import torch

from ddiloco.checks import invalid


class SessionLifecycle:
    """Base of the session objects that `ddiloco.session()` returns. Subclasses implement `_open()` (what
    `start()` does once the session is entered), `request_stop()` and `close(failed=...)`, and have `inner_step` and
    `inner_steps` (the learner's inner steps so far and the run's budget)."""

    inner_step: int
    inner_steps: int

    def __init__(self, *, handle_sigterm: bool) -> None:
        self._handle_sigterm = handle_sigterm
        self._previous_handler: Any = None
        self._entered = False
        self._closed = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def start(self) -> None:
        """Enter the session (once); what that does is the subclass's `_open()`."""
        if self._entered:
            raise RuntimeError("a session is started once")
        self._entered = True
        if self._handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self.request_stop())
        self._open()

    def _open(self) -> None:
        raise NotImplementedError

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
        """The SIGTERM handler from before the session, back in place."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
