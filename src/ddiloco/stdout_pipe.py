"""What a command does when the reader of its stdout goes away (`ddiloco run ... | head -3`, or the terminal it ran
in closed): it stops writing to it and goes on, so that a run, its faults and its files carry on as they would with
the console open. Python ignores SIGPIPE, so a write to the closed pipe raises BrokenPipeError; Rich's console would
exit(1) on it, which ended a run mid-way. A terminal that hung up raises OSError EIO instead, which Rich does not
catch: `ddiloco run` in a closed terminal crashed with a traceback while it stopped, before its summary. Both mean the
same here. After the first one, stdout's file descriptor is pointed at /dev/null, so that Python's last flush at
exit, which still holds the unwritten bytes, does not fail too.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import IO, Any

from rich.console import Console


def silence_stdout(stream: IO[str] | None = None) -> None:
    """Point the file descriptor of `stream` (stdout) at /dev/null: its reader is gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, (stream or sys.stdout).fileno())
    finally:
        os.close(devnull)


def reader_gone(exc: OSError) -> bool:
    """Whether a failed write means stdout's reader is gone: a closed pipe, or a terminal that hung up (EIO)."""
    return isinstance(exc, BrokenPipeError) or exc.errno == errno.EIO


class _HungUpAsClosedPipe:
    """A stream whose writes raise BrokenPipeError where a terminal that hung up raises EIO, for Rich, which handles
    only the first (`Console.on_broken_pipe`). Everything else is the stream's own."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._call(self._stream.write, text)

    def flush(self) -> None:
        self._call(self._stream.flush)

    @staticmethod
    def _call(method, *args):
        try:
            return method(*args)
        except OSError as exc:
            if reader_gone(exc) and not isinstance(exc, BrokenPipeError):
                raise BrokenPipeError(errno.EPIPE, f"stdout's terminal hung up ({exc.strerror})") from exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class StdoutLines:
    """`say(line)`: a line on stdout, flushed, until stdout closes; from then on nothing."""

    def __init__(self) -> None:
        self.closed = False

    def __call__(self, line: str) -> None:
        if self.closed:
            return
        try:
            print(line, file=sys.stdout, flush=True)
        except OSError as exc:
            if not reader_gone(exc):
                raise
            self.closed = True
            silence_stdout(sys.stdout)


class PipeConsole(Console):
    """A Rich console on stdout (or `file=`) that goes quiet when its reader is gone, where Rich's own would exit(1),
    or raise on a terminal that hung up."""

    def __init__(self, *, file: IO[str] | None = None, **kwargs: Any) -> None:
        super().__init__(file=_HungUpAsClosedPipe(file or sys.stdout), **kwargs)  # type: ignore[arg-type]

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout(self.file)
