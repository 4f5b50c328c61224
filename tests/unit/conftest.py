"""Fixtures shared by the unit tests."""

import pytest

from tests.fake_learners import write_fake_command


@pytest.fixture
def fake_command(tmp_path_factory) -> tuple[str, ...]:
    return write_fake_command(tmp_path_factory.mktemp("fake"))


@pytest.fixture
def no_work(monkeypatch):
    """Any experiment, simulation or chaos system that starts fails the test: a refusal of the command's arguments or
    output folder must come first."""
    def started(*args, **kwargs):
        raise AssertionError("the work started before the command's arguments and output folder were checked")

    for target in ("ddiloco.sim.experiments.run_experiment", "ddiloco.plan.commands.simulate",
                   "ddiloco.plan.commands.run_paper_grid", "ddiloco.chaos.runner.run_runtime_system",
                   "ddiloco.chaos.runner.run_data_parallel_system"):
        monkeypatch.setattr(target, started)
