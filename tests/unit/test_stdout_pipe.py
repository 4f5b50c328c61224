"""A command whose stdout's reader went away (`ddiloco experiment ... | head -1`) goes on quietly: Rich's console
exited 1 on the first write to the closed pipe, which ended a run mid-way (`ddiloco.stdout_pipe`)."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from ddiloco.stdout_pipe import PipeConsole


@pytest.fixture
def closed_pipe():
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as stream:
        yield stream


def test_rich_s_own_console_exits_on_a_closed_pipe(closed_pipe):
    # What PipeConsole is for: the plain console ends the process.
    with pytest.raises(SystemExit):
        Console(file=closed_pipe).print("x" * 10_000)


def test_a_pipe_console_goes_quiet_and_later_lines_are_dropped(closed_pipe):
    console = PipeConsole(file=closed_pipe)
    console.print("x" * 10_000)
    assert console.quiet
    console.print("more")  # nothing raised
    closed_pipe.write("the last flush at exit")
    closed_pipe.flush()  # the descriptor is /dev/null now


@pytest.fixture
def hung_up_terminal():
    """A terminal whose other side closed: a write to it fails with EIO (a closed ssh session, a closed window)."""
    controller, terminal = os.openpty()
    os.close(controller)
    with open(terminal, "w") as stream:
        yield stream


def test_a_pipe_console_goes_quiet_on_a_terminal_that_hung_up(hung_up_terminal):
    # `ddiloco run` in a terminal that closed crashed with `OSError: [Errno 5] Input/output error` from Rich while it
    # stopped its children, and wrote no summary.
    with pytest.raises(OSError, match="Input/output error"):
        hung_up_terminal.write("x")
        hung_up_terminal.flush()
    console = PipeConsole(file=hung_up_terminal)
    console.print("x" * 10_000)
    assert console.quiet
    console.print("more")  # nothing raised
    hung_up_terminal.write("the last flush at exit")
    hung_up_terminal.flush()


def test_stdout_lines_stop_on_a_terminal_that_hung_up(hung_up_terminal, monkeypatch):
    from ddiloco.stdout_pipe import StdoutLines

    monkeypatch.setattr("sys.stdout", hung_up_terminal)
    say = StdoutLines()
    say("x" * 10_000)
    assert say.closed
    say("more")
