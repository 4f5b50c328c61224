"""`ddiloco.session` in process (the hub): joining, the budget, checkpoints of the user's state, errors."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import ddiloco
from ddiloco.environment import environment
from ddiloco.exit_status import RefusedError
from ddiloco.inprocess import JoinRefusedError
from tests.helpers import TinyNet, flip_bit_in_tensor_data, make_batches, train_step

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")


class Cursor:
    """A data position the session checkpoints (anything with state_dict / load_state_dict)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def hub():
    return ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))


def test_the_first_learner_is_the_genesis_and_later_ones_load_it():
    shared = hub()
    first, second = TinyNet(seed=1), TinyNet(seed=2)
    genesis = {n: p.detach().clone() for n, p in first.named_parameters()}
    with (ddiloco.session(first, torch.optim.SGD(first.parameters(), lr=0.1), hub=shared, learner_id=0),
          ddiloco.session(second, torch.optim.SGD(second.parameters(), lr=0.1), hub=shared, learner_id=1)):
        assert all(torch.equal(genesis[n], p) for n, p in second.named_parameters())
    assert shared.syncer is not None and shared.syncer.plan.embeddings == {"token_embedding.weight"}


def test_a_session_trains_to_its_budget_checkpoints_and_resumes_the_users_state(tmp_path):
    shared = hub()
    model = TinyNet(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cursor = Cursor()
    with ddiloco.session(model, optimizer, state={"data": cursor}, hub=shared, learner_id=0, inner_steps=6,
                         run_dir=tmp_path) as sync:
        batches = iter(make_batches(10, seed=0))
        while not sync.done:
            cursor.position += 1
            sync.step(tokens=train_step(model, optimizer, next(batches)), loss=1.0)
    assert sync.inner_step == sync.inner_steps == 6 and sync.final_state == "done"
    assert shared.syncer.rounds_committed >= 3  # rounds at steps 2, 4, 6, and the final flush
    status = (tmp_path / "learners" / "0" / "status.json").read_text()
    assert '"state": "done"' in status

    # A new process of the same learner: its optimizer, schedule position and data cursor come back.
    again, cursor2 = TinyNet(seed=5), Cursor()
    optimizer2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    with ddiloco.session(again, optimizer2, state={"data": cursor2}, hub=shared, learner_id=0, inner_steps=8,
                         run_dir=tmp_path) as resumed:
        assert resumed.inner_step == 6 and cursor2.position == 6
        assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
        while not resumed.done:
            resumed.step(tokens=4)
    assert resumed.inner_step == 8


def _train(shared, run_dir, *, inner_steps: int):
    """One process of learner 0: resumes from its checkpoint in `run_dir`, trains to `inner_steps`."""
    model, cursor = TinyNet(seed=1), Cursor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ddiloco.session(model, optimizer, state={"data": cursor}, hub=shared, learner_id=0, inner_steps=inner_steps,
                         run_dir=run_dir) as sync:
        resumed_at = (sync.inner_step, cursor.position)
        batches = iter(make_batches(inner_steps, seed=0))
        while not sync.done:
            cursor.position += 1
            sync.step(tokens=train_step(model, optimizer, next(batches)), loss=1.0)
    return resumed_at


def test_a_learner_whose_newest_checkpoint_is_damaged_resumes_from_the_older_one(tmp_path, caplog):
    shared = hub()
    _train(shared, tmp_path, inner_steps=3)
    _train(shared, tmp_path, inner_steps=6)
    checkpoints = tmp_path / "learners" / "0" / "checkpoint"
    flip_bit_in_tensor_data(checkpoints / "state_000000006.safetensors")
    with caplog.at_level(logging.INFO):
        assert _train(shared, tmp_path, inner_steps=8) == (3, 3)
    assert "state_000000006.json is damaged" in caplog.text
    assert "[learner 0 | inner 3] resumed from its checkpoint" in caplog.text

    # Every kept checkpoint damaged (6 already is): a cold start, as on a new machine, said as such.
    assert sorted(p.name for p in checkpoints.glob("state_*.safetensors")) == \
        ["state_000000006.safetensors", "state_000000008.safetensors"]
    flip_bit_in_tensor_data(checkpoints / "state_000000008.safetensors")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _, position = _train(shared, tmp_path, inner_steps=30)  # (it takes the global schedule position)
    assert position == 0 and "resumed from its checkpoint" not in caplog.text
    assert "all 2 kept are damaged" in caplog.text and "[learner 0] no readable checkpoint" in caplog.text


def test_bad_input_is_refused_with_a_clear_message():
    model = TinyNet()
    other = TinyNet()
    with pytest.raises(ValueError, match="optimizer holds none of the model"):
        ddiloco.session(model, torch.optim.SGD(other.parameters(), lr=0.1), hub=hub(), learner_id=0)
    with pytest.raises(TypeError, match="needs state_dict"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0,
                        state={"data": object()})
    with pytest.raises(ValueError, match="no syncer"):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with (ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0) as sync,
          pytest.raises(ValueError, match="tokens=-1")):
        sync.step(tokens=-1)


def test_a_session_declares_its_tokens_per_step_and_keeps_to_them():
    shared = hub()
    model = TinyNet()
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0,
                         max_tokens_per_step=24) as sync:
        assert shared.syncer.learners[0].declared_tokens_per_step == 24
        sync.step(tokens=24)
        with pytest.raises(ValueError, match="tokens=25 is more than the max_tokens_per_step=24"):
            sync.step(tokens=25)
        assert sync.inner_step == 1


def test_a_refused_learner_raises_a_system_exit_with_status_3():
    shared = hub()
    model = TinyNet()
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0):
        pass
    wider = TinyNet(width=12)  # another model than the run's genesis
    with pytest.raises(RefusedError) as caught:
        ddiloco.session(wider, torch.optim.SGD(wider.parameters(), lr=0.1), hub=shared, learner_id=1).start()
    assert caught.value.code == 3 and "model differs" in caught.value.reason


def test_the_environment_ddiloco_run_sets():
    env = environment({"DDILOCO_SYNCER": "127.0.0.1:5", "DDILOCO_LEARNER_ID": "2", "DDILOCO_NUM_LEARNERS": "3",
                       "DDILOCO_DEVICE": "cuda:1", "DDILOCO_ROLE": "evaluator", "DDILOCO_SEED": "7"})
    assert (env.learner_id, env.num_learners, env.device, env.role, env.seed) == (2, 3, "cuda:1", "evaluator", 7)
    assert env.managed and not environment({}).managed
    with pytest.raises(ValueError, match="DDILOCO_LEARNER_ID=3"):
        environment({"DDILOCO_LEARNER_ID": "3", "DDILOCO_NUM_LEARNERS": "3"})
    with pytest.raises(ValueError, match="expected an integer"):
        environment({"DDILOCO_LEARNER_ID": "one"})


def test_the_environment_reads_torchruns_rank_and_world_size():
    env = environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    assert (environment({}).rank, environment({}).world_size) == (0, 1)
    with pytest.raises(ValueError, match="RANK=2 is invalid with WORLD_SIZE=2"):
        environment({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is invalid"):
        environment({"WORLD_SIZE": "two"})


def test_a_learner_in_bfloat16_trains_against_float32_global_state():
    # Mixed precision: the learner's parameters (and its autocast) in bf16; the syncer's global model in float32.
    shared = hub()
    model = TinyNet(seed=1).to(torch.bfloat16)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loaded = 0
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=8) as sync:
        for batch in make_batches(8, seed=0):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                tokens = train_step(model, optimizer, batch)
            before = list(sync.learner.versions)
            sync.step(tokens=tokens)
            global_params = shared.syncer.global_params()
            for p, names in enumerate(sync.learner.plan.fragments):
                if sync.learner.versions[p] > before[p]:  # a round came back: the global value, rounded to bf16
                    loaded += 1
                    assert all(torch.equal(params[n], global_params[n].to(torch.bfloat16)) for n in names)
    assert loaded >= 3 and shared.syncer.rounds_committed >= 4
    assert {t.dtype for t in shared.syncer.global_params().values()} == {torch.float32}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_model_whose_parameter_is_a_strided_view_trains_with_the_default_codecs():
    # nn.Parameter(w.t()) is not contiguous. The syncer's copy of it was not either, and its first close (the fused
    # int8 one, the default downlink) stopped with "expected a contiguous float32 CPU tensor".
    shared = ddiloco.InProcessHub(config=ddiloco.DilocoConfig(num_fragments=2, sync_every=4),
                                  quorum=ddiloco.QuorumConfig(grace="none"))
    model = TinyNet(seed=1)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).t())
    assert not model.lm_head.weight.is_contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params, loaded = dict(model.named_parameters()), 0
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=12) as sync:
        for batch in make_batches(12, seed=0):
            before = list(sync.learner.versions)
            sync.step(tokens=train_step(model, optimizer, batch))
            global_params = shared.syncer.global_params()
            for p, names in enumerate(sync.learner.plan.fragments):
                if sync.learner.versions[p] > before[p]:
                    loaded += 1
                    assert all(torch.equal(params[n], global_params[n]) for n in names)
    assert loaded >= 4 and shared.syncer.rounds_committed >= 5
    assert "lm_head.weight" in {n for names in sync.learner.plan.fragments for n in names}


def test_initial_parameters_holding_nan_are_refused_naming_the_tensor():
    # Over gRPC the wire layer refuses such a genesis; in process the hub took it, and NaN went into every round.
    model = TinyNet(seed=1)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (pytest.raises(JoinRefusedError, match="'lm_head.weight' holds NaN or Inf"),
          ddiloco.session(model, optimizer, hub=hub(), learner_id=0)):
        pass


def test_a_loop_that_ends_before_the_budget_stops_the_session_with_a_warning(caplog):
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), ddiloco.session(model, optimizer, hub=hub(), learner_id=0,
                                                           inner_steps=8) as sync:
        for batch in make_batches(3, seed=0):  # the user's data ran out
            sync.step(tokens=train_step(model, optimizer, batch))
    assert sync.final_state == "stopped" and sync.inner_step == 3
    assert "its loop ended before the run's budget of 8 inner steps" in caplog.text


@pytest.mark.parametrize("code", [0, None])
def test_sys_exit_0_inside_the_session_ends_it_as_a_break_does(code):
    # Early stopping by `sys.exit(0)`: the session ended `failed`, its last work never sent (a probe: 3 rounds
    # committed where a `break` at the same step made 7).
    shared = hub()
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained = 0
    with pytest.raises(SystemExit), ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=8) as sync:
        for batch in make_batches(6, seed=0):
            tokens = train_step(model, optimizer, batch)
            sync.step(tokens=tokens)
            trained += tokens
        raise SystemExit(code)
    assert sync.final_state == "stopped" and sync.inner_step == 6
    assert sync.learner.unpublished() == [0, 0]
    assert shared.syncer.learners[0].tokens_merged == CONFIG.num_fragments * trained  # (each fragment's update counts)


def test_sys_exit_with_an_error_status_inside_the_session_is_a_failure():
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SystemExit), ddiloco.session(model, optimizer, hub=hub(), learner_id=0, inner_steps=8) as sync:
        for batch in make_batches(6, seed=0):
            sync.step(tokens=train_step(model, optimizer, batch))
        raise SystemExit(2)
    assert sync.final_state == "failed" and sync.learner.unpublished() != [0, 0]


def test_an_in_process_session_never_closed_and_dropped_is_let_go_and_its_learner_can_start_again():
    # A notebook cell started a session and a Ctrl-C kept it from its close: the process's registry of open sessions
    # kept it, its model and optimizer for the life of the process, and refused the re-run's session of the learner.
    import gc
    import weakref

    shared = hub()
    model = TinyNet(seed=1)
    sync = ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0,
                           inner_steps=8)
    sync.start()
    sync.step(tokens=train_step(model, sync.optimizer, make_batches(1, seed=0)[0]))
    gone, first_model = weakref.ref(sync), weakref.ref(model)
    del sync, model
    gc.collect()
    assert gone() is None
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0,
                         inner_steps=8) as again:
        for batch in make_batches(8, seed=1):
            again.step(tokens=train_step(model, again.optimizer, batch))
    assert again.final_state == "done"
    del shared, again
    gc.collect()
    assert first_model() is None  # the hub held it; nothing else does


def test_a_second_session_of_a_learner_whose_first_is_still_held_is_refused():
    shared = hub()
    model = TinyNet(seed=1)
    with (ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0),
          pytest.raises(RuntimeError, match="a second ddiloco.session")):
        ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0).start()


def test_a_compiled_model_syncs_under_its_plain_names_beside_a_plain_learner():
    # torch.compile wraps the module: its parameters are named `_orig_mod.*`. Under those names the export did not
    # load into the plain model, and a compiled learner was refused by a run of plain ones.
    shared = hub()
    compiled, plain = torch.compile(TinyNet(seed=1), backend="eager"), TinyNet(seed=2)
    assert all(name.startswith("_orig_mod.") for name, _ in compiled.named_parameters())
    with (ddiloco.session(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), hub=shared, learner_id=0) as sync,
          ddiloco.session(plain, torch.optim.SGD(plain.parameters(), lr=0.1), hub=shared, learner_id=1)):
        names = [t.name for t in shared.syncer.spec.tensors]
        assert sorted(names) == sorted(name for name, _ in plain.named_parameters())
        assert all(torch.equal(p, q) for p, q in zip(compiled.parameters(), plain.parameters(), strict=True))
        assert sync.model is compiled  # as given: a loop that calls sync.model runs it compiled (it was the plain one)


def test_a_session_without_a_budget_ends_its_loop_without_a_warning(caplog):
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), ddiloco.session(model, optimizer, hub=hub(), learner_id=0) as sync:
        for batch in make_batches(3, seed=0):
            sync.step(tokens=train_step(model, optimizer, batch))
        with pytest.raises(ValueError, match=r"tokens=tensor\(4\) is invalid.*pass int\(t\)"):
            sync.step(tokens=torch.tensor(4))
    assert sync.final_state == "stopped" and "budget" not in caplog.text


def test_a_lazy_module_not_yet_run_is_refused_with_what_to_do():
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not initialized yet .* run one forward pass"):
        ddiloco.session(model, optimizer, hub=hub(), learner_id=0)
    model(torch.zeros(1, 3))  # its shapes are known now
    with ddiloco.session(model, optimizer, hub=hub(), learner_id=0) as sync:
        assert sync.learner.plan.num_fragments >= 1


def test_a_model_with_one_layer_in_bf16_joins_and_syncs():
    # Its fragments were cut by bytes, so not where the syncer's float32 copy was: it never joined.
    shared = hub()
    model = TinyNet(seed=1)
    model.blocks[0].to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=8) as sync:
        while not sync.done:
            sync.step(tokens=4)
    assert sync.final_state == "done" and shared.syncer.rounds_committed >= 4
    assert model.blocks[0].weight.dtype == torch.bfloat16


def test_a_generator_in_state_resumes_its_draws(tmp_path):
    # A torch.Generator has get_state/set_state, not state_dict: it was refused as state.
    shared, model = hub(), TinyNet(seed=1)
    generator = torch.Generator().manual_seed(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddiloco.session(model, optimizer, state={"order": generator}, hub=shared, learner_id=0, inner_steps=4,
                         run_dir=tmp_path) as sync:
        while not sync.done:
            torch.randint(0, 100, (3,), generator=generator)
            sync.step(tokens=4)
    expected = torch.randint(0, 100, (3,), generator=generator)  # the draw after the checkpoint's
    again, model2 = torch.Generator().manual_seed(123), TinyNet(seed=1)
    with ddiloco.session(model2, torch.optim.SGD(model2.parameters(), lr=0.1), state={"order": again},
                         hub=shared, learner_id=0, inner_steps=6, run_dir=tmp_path) as resumed:
        assert resumed.inner_step == 4
        assert torch.equal(torch.randint(0, 100, (3,), generator=again), expected)
    with pytest.raises(TypeError, match=r"state\['x'\] \(object\) needs state_dict\(\) and load_state_dict\(\)"):
        ddiloco.session(model, optimizer, state={"x": object()}, hub=hub(), learner_id=0)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(TypeError, match=r"state\['data'\] is a torch DataLoader, which keeps no position.*"
                                        r"StatefulDataLoader.*generator=g"):
        ddiloco.session(model, optimizer, state={"data": loader}, hub=hub(), learner_id=0)


class NumpyCursor:
    """A data position kept in numpy: an array of counts and an np.int64 (a checkpoint skipped them, silently)."""

    def __init__(self) -> None:
        self.seen, self.batches = np.zeros(3, dtype=np.float32), np.int64(0)

    def state_dict(self):
        return {"seen": self.seen, "batches": self.batches}

    def load_state_dict(self, state):
        self.seen, self.batches = state["seen"], state["batches"]


def test_a_state_holding_numpy_values_is_checkpointed_and_resumes_as_it_was(tmp_path):
    shared, model, cursor = hub(), TinyNet(seed=1), NumpyCursor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddiloco.session(model, optimizer, state={"data": cursor}, hub=shared, learner_id=0, inner_steps=4,
                         run_dir=tmp_path) as sync:
        while not sync.done:
            cursor.seen += 1
            cursor.batches += 1
            sync.step(tokens=4)
    again, model2 = NumpyCursor(), TinyNet(seed=1)
    with ddiloco.session(model2, torch.optim.SGD(model2.parameters(), lr=0.1), state={"data": again}, hub=shared,
                         learner_id=0, inner_steps=6, run_dir=tmp_path) as resumed:
        assert resumed.inner_step == 4
    assert type(again.seen) is np.ndarray and again.seen.dtype == np.float32 and again.seen.tolist() == [4.0] * 3
    assert type(again.batches) is np.int64 and again.batches == 4


class TaggedCursor(Cursor):
    def state_dict(self):
        return {"position": self.position, "tags": {"a", "b"}}


def test_a_state_the_checkpoint_cannot_keep_stops_the_loop_at_its_first_step_naming_the_entry(tmp_path, caplog):
    # The checkpoint thread raised it, so it only showed in the log and no checkpoint was ever written.
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (caplog.at_level(logging.ERROR),
          pytest.raises(TypeError, match=r"learner 0 cannot checkpoint the set at /tags in state\['data'\]"
                                         r"\.state_dict\(\)\. A checkpoint keeps dicts .*a set as a sorted list"),
          ddiloco.session(model, optimizer, state={"data": TaggedCursor()}, hub=hub(), learner_id=0,
                          inner_steps=4, run_dir=tmp_path) as sync):
        sync.step(tokens=4)
    assert sync.final_state == "failed" and sync.inner_step == 0
    assert "no checkpoint: learner 0 cannot checkpoint the set at /tags" in caplog.text  # the closing one, logged


class SpectrumCursor(Cursor):
    def state_dict(self):
        return {"position": self.position, "spectrum": torch.zeros(3, dtype=torch.complex128)}


def test_a_tensor_of_a_dtype_the_checkpoint_cannot_keep_stops_the_loop_at_its_first_step(tmp_path, caplog):
    # safetensors has no complex128: the background write failed, after the loop had gone on.
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (caplog.at_level(logging.ERROR),
          pytest.raises(TypeError, match=r"learner 0 cannot checkpoint the Tensor of dtype complex128 at /spectrum in "
                                         r"state\['data'\]\.state_dict\(\)\. A checkpoint keeps .*torch tensors of "
                                         r"dtype .*complex64"),
          ddiloco.session(model, optimizer, state={"data": SpectrumCursor()}, hub=hub(), learner_id=0,
                          inner_steps=4, run_dir=tmp_path) as sync):
        sync.step(tokens=4)
    assert sync.final_state == "failed" and sync.inner_step == 0


def test_a_run_resumed_with_a_changed_model_fails_saying_the_model_changed(tmp_path):
    shared = hub()
    _train(shared, tmp_path, inner_steps=2)
    model = TinyNet(seed=1)
    model.blocks.append(torch.nn.Linear(8, 8))  # a layer added to the script since the run started
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"learner 0's checkpoint in .* holds optimizer state for 1 parameter group "
                                         r"of 6 parameters, but this script's optimizer has 1 parameter group of 8 "
                                         r"parameters: the model .* changed since the run started. Resume with the "
                                         r"model the run started with, or start a new run"):
        ddiloco.session(model, optimizer, hub=shared, learner_id=0, inner_steps=4, run_dir=tmp_path).start()


def test_updates_that_count_no_tokens_are_warned_about_once(caplog):
    model = TinyNet(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), ddiloco.session(model, optimizer, hub=hub(), learner_id=0,
                                                           inner_steps=12) as sync:
        while not sync.done:
            sync.step(tokens=0)
    assert caplog.text.count("counts 0 tokens") == 1
    assert "weighs nothing and its training is lost. Pass sync.step(tokens=<tokens or samples" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING), ddiloco.session(model, optimizer, hub=hub(), learner_id=0,
                                                           inner_steps=12) as sync:
        while not sync.done:
            sync.step(tokens=0 if sync.inner_step % 2 else 4)  # (accumulation micro-steps may count none)
    assert "counts 0 tokens" not in caplog.text


def test_numpy_integers_count_as_tokens_and_only_a_tensor_gets_the_tensor_hint():
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0,
                         max_tokens_per_step=32) as sync:
        sync.step(tokens=np.int64(32))
        sync.step(tokens=np.uint8(3))
        assert sync.inner_step == 2 and sync.reporter.progress.tokens == 35
        assert type(sync.reporter.progress.tokens) is int
        with pytest.raises(ValueError, match=r"tokens=\S*32\.0\S* is invalid: expected an int >= 0 \(tokens or "
                                             r"samples in this step\)$"):
            sync.step(tokens=np.float64(32.0))
        with pytest.raises(ValueError, match=r"tokens=\S*True\S* is invalid"):
            sync.step(tokens=np.bool_(True))


def test_a_step_after_the_budget_is_refused_naming_it():
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=hub(), learner_id=0,
                         inner_steps=3) as sync:
        while not sync.done:
            sync.step(tokens=4)
        with pytest.raises(RuntimeError, match=r"sync.step\(\) after the run's budget of 3 inner steps: sync.done is "
                                               r"true from there on"):
            sync.step(tokens=4)
        assert sync.inner_step == 3
    assert sync.final_state == "done"
