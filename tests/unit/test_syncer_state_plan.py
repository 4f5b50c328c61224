"""A syncer state loaded into a syncer whose fragment plan differs is refused, naming the difference. The outer
momentum is kept by position within each fragment: before, a run started by a version that cut a model into fragments
one way and resumed by one that cuts it another had each momentum buffer land on another tensor (one of the same shape
without a word; the probe's run then had 70 updates rejected as non-finite and still ended "completed"), or failed with
torch's "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"."""

from __future__ import annotations

import pytest
import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of

CONFIG, QUORUM = DilocoConfig(num_fragments=2, codec="fp32"), QuorumConfig(min_quorum=1)


def syncer(params) -> Syncer:
    return Syncer(CONFIG, QUORUM, initial_params=params)


def with_momentum(state: dict, fragment: int, position: int, shape: tuple[int, ...]) -> dict:
    state["outer"][fragment]["state"] = {position: {"momentum_buffer": torch.ones(shape)}}
    return state


def test_a_state_of_another_fragment_plan_is_refused_naming_the_fragment():
    params = params_of(TinyNet(seed=1))
    written = syncer(params)
    other = syncer(dict(reversed(params.items())))  # the same tensors, cut into fragments in another order
    assert other.plan.fragments != written.plan.fragments
    with pytest.raises(ValueError, match="written with another fragment plan \\(fragment 0 held ") as caught:
        other.load_state_dict(written.state_dict())
    assert "resume the run with the version that started it" in str(caught.value)
    same = syncer(params)
    same.load_state_dict(written.state_dict())  # its own plan loads as before
    assert same.versions == written.versions


def test_a_state_from_before_the_plan_was_saved_is_checked_by_its_momentums_shapes():
    params = params_of(TinyNet(seed=1))
    written = syncer(params)
    first = written.plan.fragments[0][0]
    old = with_momentum(written.state_dict(), 0, 0, tuple(params[first].shape))
    del old["fragments"]  # written before 2026-12-06
    syncer(params).load_state_dict(old)  # momentum that fits its tensor loads
    misfit = with_momentum(written.state_dict(), 0, 0, (3, 5))
    del misfit["fragments"]
    with pytest.raises(ValueError, match=f"fragment 0's momentum at position 0 has shape \\(3, 5\\), where this "
                                         f"syncer's plan puts '{first}'"):
        syncer(params).load_state_dict(misfit)


def test_a_state_from_before_the_plan_was_saved_is_checked_by_the_round_files_names(tmp_path):
    # The shapes check alone passed a model of blocks of one shape: 4 x Linear(64, 64) cut [[layers.1, layers.3, head],
    # [layers.0, layers.2]] by the version that started the run and [[layers.0, layers.2, head], ...] by this one took
    # the resume without a word, each block's momentum on another block. Each round's file names its fragment's
    # tensors, as the plan that wrote it had them.
    from ddiloco.checkpoint import save_state
    from ddiloco.fragments import FragmentPlan
    from ddiloco.runtime.syncer_state import SyncerStore
    from tests.helpers import committed_rounds

    config = DilocoConfig(num_fragments=2, sync_every=4)
    initial = params_of(TinyNet(seed=100))  # committed_rounds' syncer
    _, records = committed_rounds(3, config)
    store = SyncerStore(tmp_path)
    for record in records:
        store.commit(record)
    written = Syncer(config, QuorumConfig(), initial_params=initial)
    for record in records:
        written.apply_committed([record])
    legacy = written.state_dict()
    del legacy["fragments"]
    for fragment in legacy["outer"]:
        fragment["state"] = {}  # no momentum shapes to go by either
    save_state(store.state_dir, legacy, serial=written.rounds_committed, meta={})

    same = Syncer(config, QuorumConfig(), initial_params=initial)
    assert store.restore(same, repair=False).state_rounds == 3  # its own plan loads as before
    # This model has one balanced plan whatever its order: the other version's cut is written out, two tensors swapped.
    other = Syncer(config, QuorumConfig(), initial_params=initial)
    (a, b, head), (embedding, c, d) = written.plan.fragments
    other.plan = FragmentPlan(((a, b, d), (embedding, c, head)), written.plan.embeddings)
    with pytest.raises(ValueError, match=r"written with another fragment plan \(round \d+'s file holds fragment \d "
                                         r"as \[.*\], this syncer's plan puts \[.*\] in it\)"):
        store.restore(other, repair=False)
