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
