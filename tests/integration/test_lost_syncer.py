"""A run whose syncer's state is lost (its host gone with its disk) still gives its model: each learner process writes
its copy of the global fragments it holds with its checkpoints (`learners/N/global.safetensors`), `ddiloco export
--from-learners` puts the newest version of each fragment together from the learners' directories gathered from their
hosts, and a new run starts from it with `--init`. Real `ddiloco run` processes; the copies are checked bit for bit
against a replay of the round log at the versions they hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ddiloco.round_log import RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.syncer import replay_rounds
from tests.helpers import SMALL_RUN, TINY_MODEL_FLAGS, ddiloco_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
RUN_TIMEOUT_S = 150


@pytest.mark.acceptance  # two runs: the default suite's 15 minutes
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_the_learners_copies_give_the_model_back_and_a_new_run_starts_from_it(tmp_path):
    run_dir = tmp_path / "run"
    status, output = ddiloco_run(run_dir, *SMALL_RUN, *TINY_MODEL_FLAGS, "--inner-steps", "48", "--round-files", "all",
                                 command=(sys.executable, "-m", "ddiloco.train_tinygpt"), timeout_s=RUN_TIMEOUT_S)
    assert status == 0, output
    # The syncer's host is gone: what is left are the learners' directories, gathered from their hosts.
    rescue = tmp_path / "rescue"
    shutil.copytree(run_dir / "learners", rescue / "learners")
    out = tmp_path / "rescued.safetensors"
    said = subprocess.run([sys.executable, "-m", "ddiloco.cli", "export", "--from-learners", str(rescue), "--out",
                           str(out)], cwd=REPO, check=True, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S).stdout
    assert "the global model as learners 0, 1 last held it" in said, said
    with safe_open(str(out), framework="pt") as handle:
        versions = [int(v) for v in handle.metadata()["fragment_versions"].split(",")]
    assert len(versions) == 2 and min(versions) >= 2, versions  # rounds were merged into both fragments

    # Each fragment is the syncer's value at that version: the genesis with the fragment's first `version` rounds.
    config = RunConfig.load(run_dir / "config.json")
    records = list(RoundLog(run_dir).records())
    exported = load_file(out)
    genesis = load_file(run_dir / "genesis.safetensors")
    checked = set()
    for fragment, version in enumerate(versions):
        rounds = [r for r in records if r.fragment == fragment]
        assert len(rounds) >= version
        upto = records.index(rounds[version - 1]) + 1
        replayed = replay_rounds(config.diloco, genesis, records[:upto])
        names = list(rounds[0].merged)
        assert names and all(torch.equal(exported[name], replayed[name]) for name in names), fragment
        checked.update(names)
    assert checked == set(genesis) and set(exported) >= checked  # every parameter (and tied ones under each name)

    # A new run from it: its genesis is the rescued model, bit for bit.
    again = tmp_path / "again"
    status, output = ddiloco_run(again, *SMALL_RUN, *TINY_MODEL_FLAGS, "--inner-steps", "8", "--init", str(out),
                                 command=(sys.executable, "-m", "ddiloco.train_tinygpt"), timeout_s=RUN_TIMEOUT_S)
    assert status == 0, output
    started = load_file(again / "genesis.safetensors")
    assert all(torch.equal(started[name], exported[name]) for name in started)
