"""A nested state (dicts, lists, tuples, numbers, strings, torch tensors, numpy arrays and scalars) as a checkpoint
stores it: its tensors, keyed by where they sit, for one safetensors file, and a JSON tree with a placeholder where each
tensor was (`split_state`, `join_state`; `ddiloco.checkpoint` writes both).

Dicts with keys that are not strings (a torch optimizer's state), tuples and numpy values keep their types. A value the
tree cannot hold (a set, an object, a tensor of a dtype safetensors does not store) is an `UnsupportedStateError`
naming where it sits, raised where the state is taken, not in the thread that writes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_TENSOR = "__tensor__"
_ITEMS = "__items__"
_TUPLE = "__tuple__"
_NDARRAY = "__ndarray__"
_NUMPY_SCALAR = "__numpy_scalar__"
_MARKERS = frozenset({_TENSOR, _ITEMS, _TUPLE, _NDARRAY, _NUMPY_SCALAR})
"""The keys of the placeholders in a state's JSON tree (`split_state`). A dict of the state that holds one of these
keys is stored as items, so that it never reads back as a placeholder."""
NUMPY_DTYPES = frozenset(np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64",
    "complex64"))
"""The numpy dtypes a checkpoint keeps, in native byte order: those both torch and safetensors hold, so that an array
goes into the tensors file as it is and comes back with its dtype (complex128 is torch's, not safetensors')."""
TORCH_DTYPES = frozenset((
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn,
    torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz))
"""The torch dtypes a checkpoint keeps: those safetensors writes and reads back (the installed version's, checked
dtype by dtype in tests/unit/test_checkpoint_state_values.py). Not complex128 or complex32, nor float8_e8m0fnu
(written, but not read back), nor the sub-byte and quantized ones: a tensor of those is refused where the state is
taken, not in the thread that writes it."""
CHECKPOINTABLE = ("dicts (their keys str or int), lists, tuples, None, bools, ints, floats, strings, torch tensors "
                  "of dtype bool, int8-64, "
                  "uint8-64, float16-64, bfloat16, float8 (e4m3, e5m2) or complex64, and numpy arrays and scalars of "
                  "dtype bool, int8-64, uint8-64, float16-64 or complex64")
"""What a state may hold (`split_state`), as error messages say it."""


class UnsupportedStateError(TypeError):
    """A value of a state that `split_state` cannot store. `keys` is where it sits (the dict keys and list indices
    from the state's root), `what` says what it is (`set`, `ndarray of dtype object`)."""

    def __init__(self, keys: tuple[Any, ...], what: str) -> None:
        super().__init__(f"cannot checkpoint the {what} at {state_path(keys)}: a checkpoint keeps {CHECKPOINTABLE}")
        self.keys = keys
        self.what = what


def state_path(keys: tuple[Any, ...]) -> str:
    """A place in a state as `split_state` names it: `/state/data/seen`, `/` for the root."""
    return "".join(f"/{key}" for key in keys) or "/"


def split_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (dicts, lists, tuples, numbers, strings, tensors, numpy arrays and scalars) into its
    tensors, keyed by path, and a JSON-able tree holding a placeholder where each tensor was. Dicts with non-string
    keys (torch optimizer states use int keys), tuples, numpy arrays and numpy scalars keep their types: an array or
    scalar is stored as a tensor (`torch.from_numpy`, no copy) under its own placeholder. Anything else (a set, an
    object, an array of strings, a tensor of a dtype outside TORCH_DTYPES) is an `UnsupportedStateError` naming
    where it is."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, keys: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dtype not in TORCH_DTYPES:
                raise UnsupportedStateError(keys, f"Tensor of dtype {str(value.dtype).removeprefix('torch.')}")
            path = state_path(keys)
            tensors[path] = value
            return {_TENSOR: path}
        if isinstance(value, np.ndarray | np.generic) and value.dtype in NUMPY_DTYPES:
            path = state_path(keys)
            # A scalar as a 0-d array. np.require keeps 0-d (np.ascontiguousarray makes it 1-d) and copies only an
            # array that is not C-contiguous (torch.from_numpy refuses negative strides).
            tensors[path] = torch.from_numpy(np.require(value, requirements="C"))
            return {_NDARRAY if isinstance(value, np.ndarray) else _NUMPY_SCALAR: path}
        if isinstance(value, dict):
            for k in value:
                # A key is written as JSON and read back as a str or an int (`join_state`): a numpy integer failed every
                # background write, a tuple every restore, and a float (0.5) or a bool came back as another key.
                if not isinstance(k, str) and (type(k) is bool or not isinstance(k, int)):
                    raise UnsupportedStateError(keys, f"dict key {k} of type {type(k).__name__}")
            if all(isinstance(k, str) for k in value) and not (_MARKERS & set(value)):
                return {k: walk(v, (*keys, k)) for k, v in value.items()}
            return {_ITEMS: [[k, walk(v, (*keys, k))] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {_TUPLE: [walk(v, (*keys, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, (*keys, i)) for i, v in enumerate(value)]
        if value is None or isinstance(value, bool | int | float | str):  # (np.str_ is a str)
            return value
        if isinstance(value, np.ndarray | np.generic):
            raise UnsupportedStateError(keys, f"{type(value).__name__} of dtype {value.dtype}")
        raise UnsupportedStateError(keys, type(value).__name__)

    return tensors, walk(state, ())


def join_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `split_state`. Reads the trees of every version (one written before numpy values were kept
    holds none of their placeholders)."""
    if isinstance(tree, list):
        return [join_state(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        if set(tree) == {_NDARRAY}:
            return tensors[tree[_NDARRAY]].numpy()
        if set(tree) == {_NUMPY_SCALAR}:
            return tensors[tree[_NUMPY_SCALAR]].numpy()[()]  # a 0-d array's element: np.int64, np.float32, ...
        if set(tree) == {_ITEMS}:
            return {(k if isinstance(k, str) else int(k)): join_state(v, tensors) for k, v in tree[_ITEMS]}
        if set(tree) == {_TUPLE}:
            return tuple(join_state(v, tensors) for v in tree[_TUPLE])
        return {k: join_state(v, tensors) for k, v in tree.items()}
    return tree
