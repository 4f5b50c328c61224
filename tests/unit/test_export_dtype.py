"""`ddiloco export` writes every floating tensor in one dtype (`--dtype`, float32 by default): the parameters are the
syncer's float32 and the buffers as the learners hold them, and a bf16 model's export mixed the two, so a load with
assign=True (a model built on the meta device) gave float32 weights beside bf16 running statistics, and its forward
failed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ddiloco.cli import main
from ddiloco.model_buffers import snapshot_buffers, write_buffers
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_state import GenesisRecord, write_genesis


def bf16_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(torch.bfloat16)


@pytest.fixture
def run_dir(tmp_path):
    """A run of a bf16 model with BatchNorm: its float32 genesis, and one learner's bf16 buffers."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_config = RunConfig()
    dataclasses.replace(run_config, diloco=dataclasses.replace(run_config.diloco, num_fragments=2)).save(
        run_dir / "config.json")
    model = bf16_model()
    write_genesis(run_dir, GenesisRecord({n: p.detach().float() for n, p in model.named_parameters()}, (), "a test"))
    model.train()
    model(torch.randn(16, 4, dtype=torch.bfloat16))  # running statistics of its own
    write_buffers(run_dir / "learners" / "0", snapshot_buffers(model))
    return run_dir


def loaded_with_assign(path) -> nn.Module:
    with torch.device("meta"):
        model = bf16_model()
    model.load_state_dict(load_file(path), assign=True)
    return model.eval()


@pytest.mark.parametrize("flags, dtype", [((), torch.float32), (("--dtype", "bfloat16"), torch.bfloat16),
                                          (("--dtype", "float16"), torch.float16)])
def test_every_floating_tensor_of_an_export_has_one_dtype_and_a_load_with_assign_runs(run_dir, tmp_path, flags,
                                                                                         dtype):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out), *flags]) == 0
    exported = load_file(out)
    assert {t.dtype for t in exported.values() if t.is_floating_point()} == {dtype}
    assert exported["1.num_batches_tracked"].dtype == torch.int64
    model = loaded_with_assign(out)
    assert model(torch.randn(3, 4, dtype=dtype)).dtype == dtype  # mixed dtypes failed here


def test_two_exports_of_one_run_are_the_same_bytes(run_dir, tmp_path):
    # Three exports of one run gave three sha256 sums: safetensors writes its metadata in a random order.
    outs = [tmp_path / f"model{i}.safetensors" for i in range(5)]
    for out in outs:
        assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert len({out.read_bytes() for out in outs}) == 1
    with safe_open(outs[0], "pt") as f:
        assert set(f.metadata()) == {"ddiloco_run", "rounds_committed", "buffers_of_learners"}
