"""`--init FILE`: a file that does not hold exactly the model's parameters is refused, naming every tensor it holds
that the model does not have and every parameter it lacks. It dropped a tensor the model does not have, silently.
With the built-in learner the launcher knows the model and refuses before it writes anything; with a script, the
first learner to join is refused before the genesis is written."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ddiloco.cli import main
from ddiloco.config import DilocoConfig
from ddiloco.learner import Learner
from ddiloco.messages import Join, ModelSpec
from ddiloco.model import ModelConfig
from ddiloco.run_config import DataConfig, RunConfig
from ddiloco.runtime.syncer_admission import genesis_for_join
from ddiloco.runtime.syncer_state import GenesisRecord, check_init_file, genesis_from_init
from ddiloco.train_tinygpt import initial_params
from ddiloco.transport.grpc_codec import decode_join, encode_join
from tests.helpers import TINY_MODEL_FLAGS

EXIT_USAGE = 2
PARAMS = {"embed.weight": torch.ones(4, 2), "head.weight": torch.ones(3, 2), "head.bias": torch.zeros(3)}
SHAPES = {name: tuple(t.shape) for name, t in PARAMS.items()}


def genesis(init: dict[str, torch.Tensor], aliases: tuple[tuple[str, str], ...] = ()) -> GenesisRecord | str:
    return genesis_from_init(init, list(PARAMS), ["embed.weight"], SHAPES, "--init f", aliases)


def test_a_file_with_a_tensor_the_model_does_not_have_is_refused_naming_it():
    reason = genesis({**PARAMS, "extra.weight": torch.ones(2), "probe.bias": torch.ones(1)})
    assert reason == ("the --init file holds 2 tensors the model has no parameter or buffer for: 'extra.weight', "
                      "'probe.bias' (an --init file holds the model's parameters, dict(model.named_parameters()); it "
                      "may hold the model's buffers too, as a state_dict or a ddiloco export does, which are not taken "
                      "from it: each learner keeps its own)")


def test_a_file_of_another_model_names_ten_tensors_and_counts_the_rest():
    reason = genesis({**PARAMS, **{f"other.{i:02d}": torch.ones(1) for i in range(12)}})
    assert "holds 12 tensors the model has no parameter or buffer for: 'other.00', " in reason
    assert "'other.09' and 2 more (" in reason and "'other.10'" not in reason


def test_extra_and_missing_tensors_are_named_together():
    init = {"embed.weight": PARAMS["embed.weight"], "head.bias": PARAMS["head.bias"], "head.w": torch.ones(3, 2)}
    reason = genesis(init)
    assert isinstance(reason, str)
    assert "lacks the model's parameter 'head.weight'" in reason and "'head.w'" in reason, reason


def test_a_tied_weight_under_its_other_name_is_no_extra_tensor():
    made = genesis({**PARAMS, "lm_head.weight": PARAMS["embed.weight"]}, aliases=(("lm_head.weight", "embed.weight"),))
    assert isinstance(made, GenesisRecord) and list(made.params) == list(PARAMS)


def test_the_first_join_of_a_script_is_refused_naming_the_extra_tensor():
    join = Join(learner_id=0, model_spec=ModelSpec.from_named_tensors(PARAMS.items()), config_fingerprint="")
    reason = genesis_for_join(join, {**PARAMS, "extra.weight": torch.ones(2)}, "--init f")
    assert isinstance(reason, str) and reason.startswith("model differs from the run's --init file: ")
    assert "'extra.weight'" in reason



def test_the_models_buffers_in_the_file_are_accepted_and_not_taken(caplog):
    """A state_dict, or a ddiloco export of a BatchNorm model, holds the buffers beside the parameters."""
    buffers = {"norm.running_mean": torch.ones(2), "norm.num_batches_tracked": torch.tensor(7)}
    with caplog.at_level("INFO", logger="ddiloco.runtime.syncer_state"):
        made = genesis_from_init({**PARAMS, **buffers}, list(PARAMS), ["embed.weight"], SHAPES, "--init f",
                                 buffers=["norm.running_mean", "norm.num_batches_tracked", "norm.running_var"])
    assert isinstance(made, GenesisRecord) and list(made.params) == list(PARAMS)
    assert "--init f holds 2 of the model's buffers ('norm.running_mean', 'norm.num_batches_tracked'): not taken" \
        in caplog.text


def test_a_learner_joins_with_its_buffers_names_and_the_wire_keeps_them():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    join = Learner(DilocoConfig(num_fragments=1), learner_id=0, model=model).join_message()
    assert join.buffers == ("1.num_batches_tracked", "1.running_mean", "1.running_var")
    decoded, _ = decode_join(encode_join(join, DilocoConfig(num_fragments=1)))
    assert decoded.buffers == join.buffers
    init = {**{name: p.detach() for name, p in model.named_parameters()}, **model.state_dict()}
    assert isinstance(genesis_for_join(decoded, init, "--init f"), GenesisRecord)


def test_check_init_file_accepts_a_state_dict_of_a_model_with_buffers(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    init = tmp_path / "init.safetensors"
    save_file(model.state_dict(), str(init))
    check_init_file(init, model)
    save_file({**model.state_dict(), "2.weight": torch.ones(1)}, str(init))
    with pytest.raises(ValueError, match="no parameter or buffer for: '2.weight'"):
        check_init_file(init, model)

def tiny_params() -> dict[str, torch.Tensor]:
    tiny = ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32)
    return initial_params(RunConfig(model=tiny, data=DataConfig(context_len=32, batch_size=4)))


def test_ddiloco_run_of_the_built_in_learner_refuses_an_extra_tensor_before_writing_anything(tmp_path, capsys):
    init = tmp_path / "init.safetensors"
    save_file({**tiny_params(), "extra.weight": torch.ones(2)}, str(init))
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--inner-steps", "2", *TINY_MODEL_FLAGS,
                 "--init", str(init)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"ddiloco run: error: --init {init}: the --init file holds 1 tensor the model has no "
                          "parameter or buffer for: 'extra.weight'") and err.count("\n") == 1, err
    assert not run_dir.exists()


def test_ddiloco_run_of_the_built_in_learner_refuses_a_missing_parameter_or_another_shape(tmp_path, capsys):
    params = tiny_params()
    name = next(iter(params))
    for case, init_params in (("missing", {k: v for k, v in params.items() if k != name}),
                              ("shape", {**params, name: torch.ones(3)})):
        init = tmp_path / f"{case}.safetensors"
        save_file(init_params, str(init))
        run_dir = tmp_path / f"run-{case}"
        assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--inner-steps", "2", *TINY_MODEL_FLAGS,
                     "--init", str(init)]) == EXIT_USAGE
        assert repr(name) in capsys.readouterr().err
        assert not run_dir.exists()


def test_ddiloco_run_refuses_a_file_that_is_not_safetensors_before_writing_anything(tmp_path, capsys):
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"not a safetensors file")
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--init", str(init), "--", "python",
                 "train.py"]) == EXIT_USAGE
    assert f"--init {init} is not a readable safetensors file" in capsys.readouterr().err
    assert not run_dir.exists()
