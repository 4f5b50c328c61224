"""Smoke test: every `ddiloco experiment NAME --quick` runs, writes its run directory and reports JSON.

All six quick variants run in this one process (the harness is single-threaded and deterministic), and
one goes through the real command line to check that `--json` puts one JSON object on the last line of
stdout. The quick variants check the machinery, not the paper's claims (docs/results.md has those).
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from ddiloco.cli import main
from ddiloco.sim.experiments import EXPERIMENTS, run_experiment
from ddiloco.sim.report import write_run

torch.set_num_threads(1)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.acceptance]

QUICK_LIMIT_S = 60.0
"""Acceptance: each quick variant finishes within 60 s on the project's 2-core machine."""

EXPECTED_SYSTEMS = {
    "quality": {"data_parallel", "decoupled"},
    "failures": {"data_parallel", "elastic_data_parallel", "sync_diloco", "decoupled"},
    "heterogeneous": {"sync_diloco", "decoupled_no_grace", "decoupled"},
    "merge": {f"{m}_m{n}" for m in ("rda", "mean") for n in (2, 4, 8)},
    "compression": {"fp32", "bf16", "fp8", "int4", "int2", "int4_fp32_down"},
    "fragments": {"balanced", "strided", "single"},
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_quick_experiment_runs_and_writes_its_results(tmp_path):
    assert set(EXPERIMENTS) == set(EXPECTED_SYSTEMS)
    for name in EXPERIMENTS:
        start = time.perf_counter()
        result = run_experiment(name, quick=True)
        elapsed = time.perf_counter() - start
        assert elapsed < QUICK_LIMIT_S, f"{name} --quick took {elapsed:.1f} s"
        data = result.to_json()
        assert data["experiment"] == name and set(data["systems"]) == EXPECTED_SYSTEMS[name]
        for system, metrics in data["systems"].items():
            assert 0.0 <= metrics["goodput"] <= 1.0 + 1e-9, (name, system)  # float sums of durations
            assert 0.0 <= metrics["uptime"] <= 1.0 + 1e-9, (name, system)
            assert math.isfinite(metrics["final_val_loss"]), (name, system)
        for system, sim in result.systems.items():  # one point per moment, the last the final loss
            moments = [(point.tokens, point.time_s) for point in sim.curve]
            assert len(moments) == len(set(moments)), (name, system, moments)
            assert sim.curve[-1].val_loss == sim.metrics["final_val_loss"], (name, system)
        assert data["checks"]
        written = write_run(result, tmp_path / name)
        assert (tmp_path / name / f"results_{name}.png").stat().st_size > 0
        assert all(path.exists() for path in written)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_command_line_prints_json_last(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["experiment", "fragments", "--quick", "--json", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    data = json.loads(lines[-1])
    assert data["experiment"] == "fragments"
    assert set(data["systems"]) == {"balanced", "strided", "single"}
    assert (out / "results.md").exists() and (out / "balanced" / "events.jsonl").exists()
