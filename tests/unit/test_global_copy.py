"""Each learner's copy of the global model (`learners/N/global.safetensors`, `ddiloco.global_copy`), and `ddiloco
export --from-learners`, which puts a run's model together from those copies when the syncer's state is lost.

Before 2026-12-07 a learner's checkpoint held its optimizer and data position but no parameter (they come from the
syncer at every join): a run whose syncer host was lost with its disk had lost its model, however many learners
still held it."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ddiloco
from ddiloco.cli import main
from ddiloco.exit_status import EXIT_USAGE
from ddiloco.global_copy import GLOBAL_COPY_FILE, GlobalCopy, freshest, read, write
from ddiloco.run_config import RunConfig

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


class TiedNet(nn.Module):
    """An embedding and an output layer that share one weight: the model's state_dict names it twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def train(model, run_dir, hub, *, learner_id, inner_steps, seed):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    generator = torch.Generator().manual_seed(seed)
    with ddiloco.session(model, optimizer, hub=hub, learner_id=learner_id, inner_steps=inner_steps,
                         run_dir=run_dir) as sync:
        while not sync.done:
            tokens = torch.randint(0, 10, (8, 5), generator=generator)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, dims=1).flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=tokens.numel())


@pytest.fixture
def trained_run(tmp_path):
    """Two learners of one in-process run, one after the other (so learner 1 holds newer versions than learner 0 kept),
    and every version the syncer made of each fragment: {(fragment, version): its tensors}."""
    made: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def keep(record):
        plan = hub.syncer.plan
        params = hub.syncer.global_params()
        made[record.fragment, record.version] = {n: params[n].clone() for n in plan.fragments[record.fragment]}

    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"), on_commit=keep)
    run_dir = tmp_path / "run"
    train(TiedNet(), run_dir, hub, learner_id=0, inner_steps=12, seed=1)
    train(TiedNet(), run_dir, hub, learner_id=1, inner_steps=12, seed=2)
    return run_dir, hub, made


def test_each_learner_writes_the_fragments_it_holds_bit_for_bit_the_syncers_at_their_versions(trained_run):
    run_dir, hub, made = trained_run
    for learner_id in (0, 1):
        copy = read(run_dir / "learners" / str(learner_id) / GLOBAL_COPY_FILE)
        assert copy.learner_id == learner_id and copy.inner_step >= 12  # (1 joined at the run's round clock)
        assert copy.fragments == tuple(map(tuple, hub.syncer.plan.fragments))
        assert copy.aliases == (("head.weight", "embed.weight"),)
        assert all(version >= 2 for version in copy.versions), copy.versions  # rounds were merged into each
        for p, names in enumerate(copy.fragments):
            expected = made[p, copy.versions[p]]
            assert all(torch.equal(copy.tensors[name], expected[name]) for name in names), (learner_id, p)


def test_export_from_learners_takes_each_fragments_newest_version_and_loads_into_the_model(trained_run, tmp_path,
                                                                                              capsys):
    run_dir, hub, made = trained_run
    copies = [read(run_dir / "learners" / str(i) / GLOBAL_COPY_FILE) for i in (0, 1)]
    newest = [max(copy.versions[p] for copy in copies) for p in range(CONFIG.num_fragments)]
    assert copies[1].versions == tuple(newest) and copies[0].versions != copies[1].versions  # 1 joined later
    # An in-process run directory holds the learners' directories only, as each learner's host does: what is left
    # when the syncer's host is lost.
    assert sorted(p.name for p in run_dir.iterdir()) == ["learners"]
    out = tmp_path / "rescued.safetensors"
    assert main(["export", "--from-learners", str(run_dir), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"fragment versions {', '.join(map(str, newest))}" in said and "learners 0, 1" in said, said
    exported = load_file(out)
    for p, names in enumerate(hub.syncer.plan.fragments):
        assert all(torch.equal(exported[name], made[p, newest[p]][name]) for name in names)
    model = TiedNet()
    model.load_state_dict(exported)  # strict: both names of the tied weight are there
    assert model.head.weight is model.embed.weight and torch.equal(model.head.weight, exported["embed.weight"])


def test_a_run_whose_syncer_state_is_gone_names_the_learners_copies(trained_run, tmp_path, capsys):
    run_dir, _, _ = trained_run
    hint = (f"({run_dir} holds learners' copies of the global model, learners/N/global.safetensors: `ddiloco export "
            f"--from-learners {run_dir} --out FILE` puts the model together from them)")
    RunConfig().save(run_dir / "config.json")  # the run's config, its genesis and rounds lost
    assert main(["export", str(run_dir), "--out", str(tmp_path / "m.safetensors")]) == EXIT_USAGE
    assert capsys.readouterr().err.endswith(f"no learner has joined this run yet {hint}\n")
    (run_dir / "config.json").unlink()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "m.safetensors")]) == EXIT_USAGE
    assert capsys.readouterr().err.endswith(f"is it a ddiloco run directory? {hint}\n")
    assert not (tmp_path / "m.safetensors").exists()


def copy_of(learner_id, versions, values, fragments=(("a",), ("b", "c"))):
    tensors = {name: torch.full((2,), float(values[p])) for p, names in enumerate(fragments) if versions[p] >= 0
               for name in names}
    return GlobalCopy(learner_id, 10, fragments, tuple(versions), (), tensors)


def test_a_copy_a_killed_process_left_half_written_is_removed_at_the_next_write(tmp_path):
    directory = tmp_path / "learners" / "0"
    directory.mkdir(parents=True)
    stale = directory / f".{GLOBAL_COPY_FILE}.999999999.tmp"  # no such process
    stale.write_bytes(b"half a copy")
    write(directory, copy_of(0, (3, 5), (3.0, 5.0)))
    assert not stale.exists() and read(directory / GLOBAL_COPY_FILE).versions == (3, 5)


def test_the_newest_version_of_each_fragment_from_the_lowest_learner_holding_it(tmp_path, caplog):
    write(tmp_path / "learners" / "0", copy_of(0, (3, 5), (3.0, 5.0)))
    write(tmp_path / "learners" / "1", copy_of(1, (4, -1), (4.0, 0.0)))
    write(tmp_path / "learners" / "2", copy_of(2, (4, 2), (4.0, 2.0)))
    (tmp_path / "learners" / "3").mkdir()
    (tmp_path / "learners" / "3" / GLOBAL_COPY_FILE).write_bytes(b"torn")
    with caplog.at_level(logging.WARNING, logger="ddiloco.global_copy"):
        recovered = freshest(tmp_path)
    assert recovered.versions == (4, 5) and recovered.sources == (1, 0) and recovered.learners == (0, 1, 2)
    assert torch.equal(recovered.params["a"], torch.full((2,), 4.0))
    assert torch.equal(recovered.params["c"], torch.full((2,), 5.0))
    assert "learners/3/global.safetensors cannot be read" in caplog.text


@pytest.mark.parametrize("second, problem", [
    (copy_of(1, (3, 5), (3.0, 6.0)), "learners 0 and 1 hold version 5 of fragment 1 with other values"),
    (copy_of(1, (3, 5), (3.0, 5.0), fragments=(("a", "b"), ("c",))), "cut into other fragments"),
])
def test_copies_that_are_not_of_one_run_are_refused(tmp_path, second, problem):
    write(tmp_path / "learners" / "0", copy_of(0, (3, 5), (3.0, 5.0)))
    write(tmp_path / "learners" / "1", second)
    with pytest.raises(ValueError, match=problem):
        freshest(tmp_path)


def test_no_copy_or_a_fragment_no_learner_received_is_said(tmp_path):
    with pytest.raises(ValueError, match="holds no learner's copy of the global model"):
        freshest(tmp_path)
    write(tmp_path / "learners" / "0", copy_of(0, (3, -1), (3.0, 0.0)))
    with pytest.raises(ValueError, match="no learner's copy holds fragment 1"):
        freshest(tmp_path)


def test_a_copy_that_cannot_be_written_is_said_as_such_and_the_checkpoint_is_kept(tmp_path, caplog):
    run_dir = tmp_path / "run"
    (run_dir / "learners" / "0" / GLOBAL_COPY_FILE).mkdir(parents=True)  # the rename onto it fails
    hub = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    with caplog.at_level(logging.WARNING):
        train(TiedNet(), run_dir, hub, learner_id=0, inner_steps=8, seed=1)
    assert "cannot write learner 0's copy of the global model (global.safetensors)" in caplog.text, caplog.text
    assert "learner 0's checkpoint" not in caplog.text
    assert list((run_dir / "learners" / "0" / "checkpoint").glob("state_000000008.*"))
