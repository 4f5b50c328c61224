"""A run directory met by another ddiloco than the one that wrote it, and a resume whose syncer refuses to start: real
`ddiloco run` processes on a tiny TinyGPT (acceptance: about 45 s; the records alone: tests/unit/test_run_records.py).

- A `--resume` whose syncer refuses the run directory (a damaged round log here; a state of another config, a run of
  another version) puts back the records the start rewrote, `config.json` and `launcher/command.json`: until
  2026-12-07 it left them rewritten, with today's fields and flags, so the version that wrote the run could not read
  it any more either (an upgrade probe: one refused upgrade left a run that neither version opened).
- A run saved before `DilocoConfig` had its round-margin fields resumes: its config reads with the values it trained
  with, and its syncer state's fingerprint (a hash of the config as that version held it) is recognised
  (`DilocoConfig.fingerprints`). It was refused as "a different algorithm config", export included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.checkpoint import load_latest_state, save_state
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import SMALL_RUN, TINY_MODEL_FLAGS

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

WAIT_S = 240.0


def ddiloco_run(*args: str) -> tuple[int, str]:
    """`python -m ddiloco.cli run ARGS` to its end, in its own session (killed with its group past WAIT_S)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        return popen.wait(timeout=WAIT_S), popen.communicate()[0]
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, 9)
            popen.communicate()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A completed run of one learner, without an evaluator: copied by each test that changes it."""
    run_dir = tmp_path_factory.mktemp("upgrade") / "run"
    code, out = ddiloco_run("--run-dir", str(run_dir), *SMALL_RUN, "--learners", "1", "--inner-steps", "32",
                            "--no-evaluate", *TINY_MODEL_FLAGS)
    assert code == 0, out
    return run_dir


def copy_run(source: Path, target: Path) -> Path:
    subprocess.run(["cp", "-a", str(source), str(target)], check=True)
    return target


@pytest.mark.timeout(300)
def test_a_resume_whose_syncer_refuses_to_start_leaves_the_runs_records_as_they_were(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path / "run")
    paths = RunPaths(run_dir)
    # Records as another version may have written them: the same content, other bytes.
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(config))
    command_before = paths.learner_command.read_bytes()
    config_before = (run_dir / "config.json").read_bytes()
    lines = (run_dir / "rounds.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) >= 3
    (run_dir / "rounds.jsonl").write_text("".join([lines[0], lines[2], lines[1], *lines[3:]]))  # two rounds swapped

    code, out = ddiloco_run("--resume", str(run_dir), "--evaluate", "--checkpoint-every-s", "3")
    assert code != 0, out
    assert "the syncer cannot run" in out and "line 2 holds round 2 where round 1 should be" in out, out
    assert (run_dir / "config.json").read_bytes() == config_before
    assert paths.learner_command.read_bytes() == command_before
    assert "config.json and launcher/command.json are as they were" in out, out


@pytest.mark.timeout(300)
def test_a_run_saved_before_the_round_margins_resumes(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path / "run")
    # The run as ddiloco saved it before 2026-12-02: a diloco section without the round-margin fields, and a syncer
    # state whose fingerprint hashed that section.
    config = json.loads((run_dir / "config.json").read_text())
    old = {k: v for k, v in config["diloco"].items() if k not in ("round_margin_steps", "round_margin_gain")}
    config["diloco"] = old
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    state_dir = run_dir / "checkpoints" / "syncer"
    for path in list(state_dir.iterdir()):
        path.unlink()  # one state, rewritten: the round log replays onto it
    state, meta, serial = load_latest_state(finished_run / "checkpoints" / "syncer")
    import hashlib
    state["config_fingerprint"] = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    save_state(state_dir, state, serial=serial, meta=meta)
    rounds = len((run_dir / "rounds.jsonl").read_text().splitlines())

    code, out = ddiloco_run("--resume", str(run_dir), "--inner-steps", "48", "--json")
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["rounds_committed"] > rounds, summary
    saved = json.loads((run_dir / "config.json").read_text())["diloco"]
    assert saved["round_margin_steps"] == 0.0 and saved["round_margin_gain"] == 0.0  # what it trained with
