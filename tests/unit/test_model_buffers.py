"""A model's buffers (BatchNorm's running statistics): kept by each learner across its restarts, written beside its
checkpoint, and averaged over the learners for export and evaluation (`ddiloco.model_buffers`)."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ddiloco
from ddiloco.model_buffers import BUFFERS_FILE, load_buffers, merged_buffers, persistent_buffers

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


class NormNet(nn.Module):
    """Linear, BatchNorm, Linear; and a buffer the module rebuilds itself (not in its state_dict)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def train(model, run_dir, *, inner_steps, hub_):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    with ddiloco.session(model, optimizer, hub=hub_, learner_id=0, inner_steps=inner_steps, run_dir=run_dir) as sync:
        while not sync.done:
            x = 3.0 + 2.0 * torch.randn(16, 3, generator=generator)  # far from BatchNorm's initial mean 0, variance 1
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=16)
    return sync


def test_the_persistent_buffers_under_the_plain_names():
    model = NormNet()
    assert list(persistent_buffers(model)) == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert list(persistent_buffers(torch.compile(model))) == list(persistent_buffers(model))  # no `_orig_mod.`
    assert set(persistent_buffers(model)) == set(model.state_dict()) - {n for n, _ in model.named_parameters()}


def test_a_restarted_learner_takes_its_buffers_back_and_writes_them_beside_its_checkpoint(tmp_path):
    shared = hub()
    model = NormNet()
    train(model, tmp_path, inner_steps=6, hub_=shared)
    trained = {n: b.clone() for n, b in persistent_buffers(model).items()}
    assert trained["norm.num_batches_tracked"] == 6 and not torch.allclose(trained["norm.running_mean"],
                                                                            torch.zeros(8), atol=0.1)
    written = load_file(tmp_path / "learners" / "0" / BUFFERS_FILE)
    assert written.keys() == trained.keys() and all(torch.equal(written[n], trained[n]) for n in trained)

    again = NormNet()  # a new process of learner 0: its script builds BatchNorm at mean 0, variance 1
    sync = train(again, tmp_path, inner_steps=6, hub_=shared)
    assert sync.inner_step == 6  # resumed, trained nothing more
    assert all(torch.equal(b, trained[n]) for n, b in persistent_buffers(again).items())


def test_the_learners_buffers_are_averaged_floating_point_ones_value_by_value(tmp_path, caplog):
    def write(learner_id, mean, count, var_shape=(2,)):
        directory = tmp_path / "learners" / str(learner_id)
        directory.mkdir(parents=True)
        save_file({"bn.running_mean": torch.tensor(mean), "bn.running_var": torch.ones(var_shape),
                   "bn.num_batches_tracked": torch.tensor(count)}, directory / BUFFERS_FILE)

    write(5, [float("nan"), 1.0], 3)  # a learner whose statistics went NaN: left out of that mean
    write(2, [3.0, 5.0], 9)
    write(0, [1.0, 2.0], 7)
    write(1, [2.0, 2.0], 8, var_shape=(3,))  # another shape: left out of that buffer's mean
    (tmp_path / "learners" / "3").mkdir()
    (tmp_path / "learners" / "3" / BUFFERS_FILE).write_bytes(b"torn")
    (tmp_path / "learners" / "4").mkdir()  # a learner that has not checkpointed yet
    with caplog.at_level(logging.WARNING):
        merged, learners = merged_buffers(tmp_path)
    assert learners == [0, 1, 2, 5]
    assert "learner 3's buffers are left out" in caplog.text
    assert torch.equal(merged["bn.running_mean"], torch.tensor([2.0, 3.0]))
    assert torch.equal(merged["bn.running_var"], torch.ones(2))
    assert merged["bn.num_batches_tracked"] == 7  # not floating point: the lowest learner id's
    assert merged_buffers(tmp_path / "elsewhere") == ({}, [])


def test_loading_buffers_names_what_it_did_not_get():
    model = NormNet()
    missing = load_buffers(model, {"norm.running_mean": torch.full((8,), 4.0), "norm.running_var": torch.ones(3)})
    assert torch.equal(model.norm.running_mean, torch.full((8,), 4.0))
    assert missing == ["norm.running_var", "norm.num_batches_tracked"]


def test_infinite_values_every_learner_holds_alike_are_kept_and_an_overflowed_statistic_is_left_out(tmp_path):
    inf = float("inf")
    mask = torch.full((3, 3), -inf).triu(1)  # a causal mask: a constant buffer, -inf above the diagonal
    copies = {0: (mask, [1.0, inf]), 1: (mask, [3.0, 2.0]), 2: (mask.clone().fill_(float("nan")), [5.0, 4.0])}
    for learner_id, (own_mask, statistic) in copies.items():
        directory = tmp_path / "learners" / str(learner_id)
        directory.mkdir(parents=True)
        save_file({"mask": own_mask, "stat": torch.tensor(statistic)}, directory / BUFFERS_FILE)
    merged, learners = merged_buffers(tmp_path)
    assert learners == [0, 1, 2]
    assert torch.equal(merged["mask"], mask)  # learner 2's NaN copy left out; the -inf above the diagonal kept
    assert torch.equal(merged["stat"], torch.tensor([4.0, 3.0]))  # learner 0's overflowed copy left out
