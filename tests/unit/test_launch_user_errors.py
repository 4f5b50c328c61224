"""A learner command whose program cannot start, and an export to a directory: one line naming the mistake and
exit status 2 before anything starts or is written, never a traceback. A program that disappears during a run fails
its learner with the reason instead of ending the launcher with a traceback (real processes: the fake `ddiloco` of
tests/fake_learners.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import main
from ddiloco.run_config import RunConfig
from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.run_checks import PROCESS_MEMORY_FLOOR, require_memory_for
from ddiloco.runtime.supervised_roles import ChildState
from ddiloco.runtime.supervisor import Supervisor
from ddiloco.runtime.syncer_state import GenesisRecord, write_genesis
from tests.fake_learners import FAST

EXIT_USAGE = 2


def test_a_learner_command_whose_program_is_not_on_the_path_is_refused_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--", "pythn", "base.py"]) == EXIT_USAGE
    assert capsys.readouterr().err == ("ddiloco run: error: the learner command `pythn base.py` cannot start: there is "
                                       "no program 'pythn' on the PATH; check the command after -- (e.g. -- python "
                                       "train.py)\n")
    assert not run_dir.exists()


@pytest.mark.parametrize("flags, said", [(("--learners", "0"), "--learners=0 is invalid: expected an integer >= 1"),
                                         (("--outer-lr", "-1"), "--outer-lr=-1.0 is invalid"),
                                         (("--model-width", "0"), "--model-width=0 is invalid")])
def test_a_value_a_config_refuses_is_named_by_its_flag(tmp_path, capsys, flags, said):
    # It was named by the config's field: `num_learners=0 is invalid` for --learners 0.
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", *flags]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith(f"ddiloco run: error: {said}")
    assert not run_dir.exists()


def test_a_learner_command_naming_a_missing_or_non_executable_file_is_refused(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    for program, why in ((tmp_path / "missing", "does not exist"), (script, "is not an executable file")):
        run_dir = tmp_path / f"run-{program.name}"
        assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--", str(program)]) == EXIT_USAGE
        assert f"the learner command `{program}` cannot start: {program} {why}" in capsys.readouterr().err
        assert not run_dir.exists()


def test_a_learner_and_evaluator_whose_program_is_gone_at_their_start_fail_with_the_reason(tmp_path, fake_command):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"inner_steps": 20, "num_learners": 1}))
    gone = tmp_path / "removed-after-the-check"
    launcher = Launcher(LaunchConfig(run_dir=run_dir, num_learners=1, threads=1, command=fake_command,
                                     script=(str(gone), "train.py"), evaluator=True))
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    for slot in (*supervisor.learners, supervisor.evaluator):
        assert slot.state == ChildState.FAILED and slot.pids == [], slot
        assert slot.reason == f"cannot start {gone}: No such file or directory"


def test_export_to_a_directory_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig().save(run_dir / "config.json")
    params = {f"layer{i}.weight": torch.full((2, 3), float(i)) for i in range(RunConfig().diloco.num_fragments)}
    write_genesis(run_dir, GenesisRecord(params, (), "a test", ()))
    out = tmp_path / "exports"
    out.mkdir()
    assert main(["export", str(run_dir), "--out", str(out)]) == EXIT_USAGE
    assert capsys.readouterr().err == (f"ddiloco export: error: --out {out} is a directory: give a file path such as "
                                       f"{out / 'model.safetensors'}\n")
    assert list(out.iterdir()) == []
    assert main(["export", str(run_dir), "--out", str(out / "model.safetensors")]) == 0  # the run itself exports
    assert load_file(out / "model.safetensors").keys() == params.keys()


def test_more_learners_than_the_machines_memory_holds_are_refused_before_anything_starts(tmp_path, capsys):
    # --learners 100000 forked learners until the OOM killer took the launcher, leaving the syncer and the learners
    # started so far running.
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--learners", "100000", "--", sys.executable,
                 "train.py"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("ddiloco run: error: 100000 learner processes on this machine need at least 9766 GiB "
                          "(100 MiB each before any model), and it has "), err
    assert "run fewer (--learners, --nproc-per-learner, --standby-learners)" in err and err.count("\n") == 1
    assert not run_dir.exists()


def test_the_memory_floor_counts_every_process():
    require_memory_for(8, available=8 * PROCESS_MEMORY_FLOOR)
    with pytest.raises(ValueError, match="^9 learner processes on this machine need at least 1 GiB"):
        require_memory_for(9, available=8 * PROCESS_MEMORY_FLOOR)
