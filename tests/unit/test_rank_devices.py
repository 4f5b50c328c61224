"""Which device each rank of a learner gets (`Launcher.rank_devices`, DDILOCO_DEVICE). Several ranks of a learner whose
device is the bare `cuda` (`--device cuda`, or the GPUs Ray makes visible to a learner's actor with
`--gpus-per-learner`) used to all get `cuda`, that is cuda:0, which NCCL refuses; rank r now gets cuda:r. An indexed
device list is dealt per rank as before. No GPU is used: the devices are names, and the ranks are tiny scripts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.run_config import RunConfig
from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.rank_group import main as rank_group_main
from ddiloco.runtime.ray_options import RayOptions
from ddiloco.runtime.run_commands import launch_config
from ddiloco.runtime.run_settings import RunSettings

SCRIPT = ("python", "train.py")
EXIT_USAGE = 2


def launcher(tmp_path: Path, devices: tuple[str, ...], *, learners: int = 2, nproc: int = 2) -> Launcher:
    return Launcher(LaunchConfig(run_dir=tmp_path, num_learners=learners, threads=1, use_token=False, script=SCRIPT,
                                 devices=devices, nproc_per_learner=nproc))


@pytest.mark.parametrize(("devices", "nproc", "expected"), [
    (("cuda",), 2, [["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]]),  # each learner's ranks on GPUs 0..N-1
    (("cuda",), 1, [["cuda"], ["cuda"]]),  # one process per learner: its device as given
    (("cuda:0", "cuda:1", "cuda:2", "cuda:3"), 2, [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]),
    (("cuda:0", "cuda:1"), 2, [["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]]),
    (("cpu",), 2, [["cpu", "cpu"], ["cpu", "cpu"]]),
])
def test_each_rank_of_a_learner_gets_its_own_device(tmp_path, devices, nproc, expected):
    launch = launcher(tmp_path, devices, nproc=nproc)
    assert [launch.rank_devices(learner) for learner in range(2)] == expected


def test_under_ray_with_gpus_each_rank_gets_one_of_its_actors_gpus(tmp_path):
    settings = RunSettings(nproc_per_learner=2, threads=1)
    launch = Launcher(launch_config(settings, RunConfig(num_learners=2), tmp_path, script=SCRIPT,
                                    ray_options=RayOptions(gpus_per_learner=2), command=("ddiloco",)))
    argv = launch.learner_argv(1, "127.0.0.1:9")
    assert argv[argv.index("--devices") + 1] == "cuda:0,cuda:1"


WRITE_DEVICE = "import os, sys; open(sys.argv[1] + '/' + os.environ['RANK'], 'w').write(os.environ['DDILOCO_DEVICE'])"


def test_the_rank_group_started_for_a_learner_hands_each_rank_its_device(tmp_path):
    """The rank group's own command line, as the launcher writes it, run for real: each rank reads DDILOCO_DEVICE."""
    argv = launcher(tmp_path, ("cuda",)).learner_argv(0, "127.0.0.1:9")
    assert argv[:3] == [sys.executable, "-m", "ddiloco.runtime.rank_group"]
    group_args = argv[3:argv.index("--") + 1]
    assert rank_group_main([*group_args, sys.executable, "-c", WRITE_DEVICE, str(tmp_path)]) == 0
    assert [(tmp_path / str(rank)).read_text() for rank in range(2)] == ["cuda:0", "cuda:1"]
    assert json.loads((tmp_path / "learners" / "0" / "ranks.json").read_text())["ranks"]


def test_fewer_ray_gpus_than_ranks_is_refused_before_anything_is_written(tmp_path, capsys):
    """One GPU for two ranks would put rank 1 on a cuda:1 its actor cannot see: said at once, not a crash loop."""
    run_dir = tmp_path / "run"
    assert main(["run", "--ray", "--gpus-per-learner", "1", "--nproc-per-learner", "2", "--run-dir", str(run_dir),
                 "--", *SCRIPT]) == EXIT_USAGE
    assert capsys.readouterr().err == ("ddiloco run: error: --nproc-per-learner 2 needs a GPU for each rank: give "
                                       "--gpus-per-learner 2 (not 1)\n")
    assert not run_dir.exists()
