"""What a state may hold (`ddiloco.state_tree.split_state`): numpy arrays and scalars come back as they were, a value
it cannot keep is refused naming where it is, and trees written before numpy values were kept still load."""

import json
import re
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ddiloco.checkpoint import load_latest_state, save_state
from ddiloco.state_tree import TORCH_DTYPES, UnsupportedStateError, join_state, split_state


def test_numpy_arrays_and_scalars_come_back_with_their_types_dtypes_and_values(tmp_path):
    generator = np.random.default_rng(0)
    state = {"seen": generator.standard_normal((2, 3)).astype(np.float32),
             "order": np.arange(5, dtype=np.uint16)[::-1],  # negative strides: not contiguous
             "flags": np.array([True, False]), "empty": np.zeros((2, 0, 3)), "zero_d": np.array(7, dtype=np.int8),
             "n": np.int64(32), "lr": np.float32(0.1), "loss": np.float64(1.5), "on": np.bool_(True),
             "rng": generator.bit_generator.state, "name": np.str_("shard-0")}
    save_state(tmp_path, {"data": state}, serial=1)
    back = load_latest_state(tmp_path)[0]["data"]

    for key in ("seen", "order", "flags", "empty", "zero_d"):
        assert type(back[key]) is np.ndarray, key
        assert (back[key].dtype, back[key].shape) == (state[key].dtype, state[key].shape), key
        assert np.array_equal(back[key], state[key]), key
    for key in ("n", "lr", "loss", "on"):
        assert (type(back[key]), back[key]) == (type(state[key]), state[key]), key
    assert back["rng"] == state["rng"]  # a numpy Generator's state: a dict of (128-bit) Python ints
    assert back["name"] == "shard-0"
    back["seen"] += 1  # an array the loader goes on updating in place


def test_a_dict_whose_key_is_a_placeholder_name_comes_back_as_a_dict():
    state = {"a": {"__ndarray__": "/not/an/array"}, "b": {"__numpy_scalar__": 1}}
    tensors, tree = split_state(state)
    assert join_state(json.loads(json.dumps(tree)), tensors) == state


def test_a_tree_written_before_numpy_values_were_kept_still_loads():
    # As the previous version wrote an optimizer state and a cursor: tensor, items and tuple placeholders.
    tree = {"optimizer": {"__items__": [[0, {"step": {"__tensor__": "/optimizer/0/step"}}]]},
            "betas": {"__tuple__": [0.9, 0.95]}, "cursor": {"batches": 3}}
    back = join_state(tree, {"/optimizer/0/step": torch.tensor(3.0)})
    assert back["betas"] == (0.9, 0.95) and back["cursor"] == {"batches": 3}
    assert list(back["optimizer"]) == [0] and back["optimizer"][0]["step"].item() == 3.0


@pytest.mark.parametrize(("value", "what"), [
    ({"a"}, "set"),
    (object(), "object"),
    (np.array(["a", "b"]), "ndarray of dtype <U1"),
    (np.zeros(2, dtype=">f4"), "ndarray of dtype >f4"),  # not the native byte order
    (np.zeros(2, dtype=np.complex128), "ndarray of dtype complex128"),  # torch has it, safetensors not
    (torch.zeros(2, dtype=torch.complex128), "Tensor of dtype complex128"),
    (torch.zeros(2, dtype=torch.float8_e8m0fnu), "Tensor of dtype float8_e8m0fnu"),  # written, but not read back
])
def test_a_value_it_cannot_keep_is_refused_naming_where_it_is_and_what_is_kept(value, what):
    with pytest.raises(UnsupportedStateError, match=rf"cannot checkpoint the {what} at /state/data/2/tags: a "
                                                    r"checkpoint keeps dicts .*numpy arrays and scalars") as caught:
        split_state({"state": {"data": [1, 2, {"tags": value}]}})
    assert caught.value.keys == ("state", "data", 2, "tags")


def _round_trips(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():  # complex32 is experimental, the quantized dtypes deprecated
            warnings.simplefilter("ignore")
            tensor = torch.zeros(2, dtype=dtype)
        back = load_safetensors(save_safetensors({"x": tensor}))["x"]
    except (KeyError, NotImplementedError):  # a dtype safetensors does not know; a quantized one torch cannot fill
        return False
    return back.dtype == dtype and back.shape == tensor.shape


def test_the_tensor_dtypes_a_checkpoint_keeps_are_those_the_installed_safetensors_writes_and_reads_back():
    dtypes = {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    assert {dtype for dtype in dtypes if _round_trips(dtype)} == TORCH_DTYPES
    tensors, _ = split_state({"x": [torch.zeros(2, dtype=dtype) for dtype in sorted(TORCH_DTYPES, key=str)]})
    assert len(tensors) == len(TORCH_DTYPES)


@pytest.mark.parametrize(("key", "what"), [
    (np.int64(3), "dict key 3 of type int64"),  # every background write failed: int64 is not JSON
    ((1, 2), "dict key (1, 2) of type tuple"),  # written, then every restore failed
    (0.5, "dict key 0.5 of type float"),  # came back as 0, merged with the key 0
    (None, "dict key None of type NoneType"),
    (True, "dict key True of type bool"),  # came back as 1
])
def test_a_dict_key_it_cannot_keep_is_refused_naming_where_it_is(key, what):
    with pytest.raises(UnsupportedStateError, match=rf"cannot checkpoint the {re.escape(what)} at /state/data/counts: "
                                                    r"a checkpoint keeps dicts \(their keys str or int\)"):
        split_state({"state": {"data": {"counts": {0: 1, key: 2}}}})
    tensors, tree = split_state({"counts": {0: 1, -7: 2, "a": 3}})  # int and str keys come back as they were
    assert join_state(json.loads(json.dumps(tree)), tensors) == {"counts": {0: 1, -7: 2, "a": 3}}
