"""Fixtures shared by the integration tests."""

import pytest

from tests.helpers import Processes
from tests.standalone_syncer import TOKEN, write_token


@pytest.fixture
def procs(tmp_path):
    """Starts real ddiloco processes; kills every one of them by PID when the test ends, even on failure."""
    processes = Processes(tmp_path / "logs")
    try:
        yield processes
    finally:
        processes.kill_all()


@pytest.fixture
def run_token(tmp_path):
    """The run's token file (`ddiloco syncer --token-file`), for a syncer and learners started by hand."""
    return write_token(tmp_path / "token", TOKEN)
