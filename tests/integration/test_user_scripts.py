"""Your model under `ddiloco run -- python examples/NAME.py`: real processes, real gRPC, a real kill -9.

Each example is a plain PyTorch loop with `ddiloco.session` (no ddiloco model, data or training code).
The run trains M learners of it; one learner is killed with SIGKILL mid-run, the supervisor restarts
it, it resumes from its own checkpoint (not inner step 0) and contributes again; the evaluator's
global loss falls; `ddiloco export` writes parameters that load back into the user's model strictly.
The transformers examples need the optional extra (`pip install ddiloco[hf]`, which CI installs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddiloco.checkpoint import load_latest_state, read_json_object
from ddiloco.round_log import RoundLog
from ddiloco.runtime.run_paths import RunPaths

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
WAIT_S = 180.0
POLL_S = 0.1
FAST = ["--num-fragments", "2", "--sync-every", "8", "--threads", "1", "--eval-every-s", "1",
        "--checkpoint-every-s", "0.5"]


def wait_for(condition, what: str, popen: subprocess.Popen):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        if popen.poll() is not None:
            pytest.fail(f"ddiloco run exited ({popen.returncode}) while waiting for {what}:\n{popen.communicate()[0]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(POLL_S)
    return value


def participations(run_dir: Path, learner_id: int) -> int:
    return sum(learner_id in [p["learner_id"] for p in line["participants"]] for line in RoundLog(run_dir).lines())


def eval_losses(run_dir: Path) -> list[float]:
    path = run_dir / "evaluator" / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [line["eval/val_loss"] for line in lines if "eval/val_loss" in line]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_with_a_kill(tmp_path: Path, example: str, inner_steps: int, *, command: tuple[str, ...] = (),
                    flags: tuple[str, ...] = ()) -> Path:
    run_dir = tmp_path / "run"
    command = command or (sys.executable, f"examples/{example}.py")
    popen = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), "--no-progress",
                              "--learners", "2", "--inner-steps", str(inner_steps), "--evaluate", *FAST, *flags,
                              "--", *command],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    paths = RunPaths(run_dir)
    try:
        checkpoint_dir = paths.learner_dir(0) / "checkpoint"
        wait_for(lambda: (s := load_latest_state(checkpoint_dir)) is not None and s[2] > 0
                 and participations(run_dir, 0) >= 2, "learner 0 checkpointed and merged", popen)
        status = read_json_object(paths.learner_status(0)) or {}
        os.kill(status["pid"], signal.SIGKILL)
        _, _, checkpoint_step = load_latest_state(checkpoint_dir)
        merged_before = participations(run_dir, 0)
        # The run may well finish before a poll sees the restart: what happened is read from its files after.
        out, _ = popen.communicate(timeout=WAIT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, out
    starts = [json.loads(line) for line in (paths.learner_dir(0) / "work.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert len(starts) == 2 and starts[1]["pid"] != starts[0]["pid"]
    assert starts[1]["inner_step"] >= checkpoint_step > 0  # resumed from its own checkpoint, not inner step 0
    # The killed process had at most one update in flight per fragment (2): the rest came after the restart.
    assert participations(run_dir, 0) > merged_before + 2
    summary = read_json_object(paths.summary)
    assert summary["outcome"] == "completed"
    assert [summary["learners"][i]["state"] for i in ("0", "1")] == ["done", "done"]
    assert summary["learners"]["0"]["restarts"] == 1
    losses = eval_losses(run_dir)
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    return run_dir


def export_and_load(run_dir: Path, model: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    out = run_dir / "export.safetensors"
    subprocess.run([sys.executable, "-m", "ddiloco.cli", "export", str(run_dir), "--out", str(out)], check=True,
                   cwd=REPO, capture_output=True, timeout=WAIT_S)
    tensors = load_file(out)
    model.load_state_dict(tensors)  # strict: every key of the user's model, tied weights included
    genesis = load_file(run_dir / "genesis.safetensors")
    assert any(not torch.equal(genesis[name], tensors[name]) for name in genesis)  # it trained


@pytest.mark.acceptance
def test_the_built_in_tinygpt_as_a_script_trains_survives_a_kill_and_exports(tmp_path):
    from ddiloco.model import ModelConfig, build_model

    tiny = ("--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1", "--model-context-len", "32",
            "--data-context-len", "32", "--data-batch-size", "4")
    run_dir = run_with_a_kill(tmp_path, "tinygpt", inner_steps=1500, flags=tiny,
                              command=(sys.executable, "-m", "ddiloco.train_tinygpt"))
    export_and_load(run_dir, build_model(ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32)))


@pytest.mark.acceptance  # beside the other three scripts: the default suite keeps under 15 minutes on 2 cores
def test_a_small_mlp_trains_survives_a_kill_and_exports(tmp_path):
    run_dir = run_with_a_kill(tmp_path, "mlp", inner_steps=3000)
    export_and_load(run_dir, load_example("mlp").build_model())


@pytest.mark.acceptance
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra (transformers)")
def test_a_transformers_gpt2_with_tied_weights_trains_survives_a_kill_and_exports(tmp_path):
    run_dir = run_with_a_kill(tmp_path, "gpt2", inner_steps=240)
    export_and_load(run_dir, load_example("gpt2").build_model())


@pytest.mark.acceptance
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra (transformers)")
def test_a_mixture_of_experts_trains_survives_a_kill_and_exports(tmp_path):
    run_dir = run_with_a_kill(tmp_path, "moe", inner_steps=240)
    export_and_load(run_dir, load_example("moe").build_model())
