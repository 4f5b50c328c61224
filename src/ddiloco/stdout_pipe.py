"""What a command does when the reader of its stdout goes away (`ddiloco run ... | head -3`): it stops writing to
it and goes on, so that a run, its faults and its files carry on as they would with the console open. Python
ignores SIGPIPE, so a write to the closed pipe raises BrokenPipeError; Rich's console would exit(1) on it, which
ended a run mid-way. After the first one, stdout's file descriptor is pointed at /dev/null, so that Python's last
flush at exit, which still holds the unwritten bytes, does not fail too.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from rich.console import Console


def silence_stdout(stream: IO[str] | None = None) -> None:
    """Point the file descriptor of `stream` (stdout) at /dev/null: its reader is gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, (stream or sys.stdout).fileno())
    finally:
        os.close(devnull)


class StdoutLines:
    """`say(line)`: a line on stdout, flushed, until stdout closes; from then on nothing."""

    def __init__(self) -> None:
        self.closed = False

    def __call__(self, line: str) -> None:
        if self.closed:
            return
        try:
            print(line, file=sys.stdout, flush=True)
        except BrokenPipeError:
            self.closed = True
            silence_stdout(sys.stdout)


class PipeConsole(Console):
    """A Rich console on stdout that goes quiet when stdout closes, where Rich's own would exit(1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout(self.file)
