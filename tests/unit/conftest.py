"""Fixtures shared by the unit tests."""

import pytest

from tests.fake_learners import write_fake_command


@pytest.fixture
def fake_command(tmp_path_factory) -> tuple[str, ...]:
    return write_fake_command(tmp_path_factory.mktemp("fake"))
