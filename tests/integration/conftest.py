"""Fixtures shared by the integration tests."""

import pytest

from tests.helpers import Processes


@pytest.fixture
def procs(tmp_path):
    """Starts real ddiloco processes; kills every one of them by PID when the test ends, even on failure."""
    processes = Processes(tmp_path / "logs")
    try:
        yield processes
    finally:
        processes.kill_all()
