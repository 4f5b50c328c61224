"""What `sync.step(tokens, loss=...)` accepts beyond `SessionLifecycle._check_step` (inside the session, within the
budget, `tokens` an integer >= 0): a `loss` that is one number, and `tokens` within what the syncer accepts; and what
`sync.log(metrics)` accepts: names of the script's own and one number each.

Both are checked before the inner step counts, so that a bad value is an error naming it in the user's loop, not
torch's message after the step went out ("only one element tensors can be converted to Python scalars") or an
update the syncer rejects as bad_counters at every round while the loop trains on.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any

import torch

from ddiloco.checks import invalid

_LOSS = "one number (the step's loss: a float, or a tensor of one element: loss.item())"
_METRIC = "one number (a float, or a tensor or array of one element)"
LEARNER_METRICS = ("loss", "tokens", "step_s", "wait_s", "tokens_per_s")
"""What ddiloco itself logs for a learner, as `learner/N/NAME`: a metric of the script's may not take these names."""
_METRIC_NAME = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


def step_loss(loss: Any) -> float | None:
    """`loss` as a float (None stays None): a Python or numpy number, or a tensor or array of one element (read
    without its autograd graph). A bool, a string or several values raise, naming it."""
    return None if loss is None else _scalar("loss", loss, _LOSS)


def _scalar(name: str, value: Any, expected: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}=<a tensor of shape {tuple(value.shape)}> is invalid: expected {expected}")
        return float(value.detach())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    size = getattr(value, "size", None)
    if callable(getattr(value, "item", None)) and isinstance(size, int) and value.dtype.kind in "iuf":  # numpy
        if size != 1:
            raise ValueError(f"{name}=<an array of shape {tuple(value.shape)}> is invalid: expected {expected}")
        return float(value.item())
    raise TypeError(f"{invalid(name, value, expected)}, got a {type(value).__name__}")


def user_metrics(prefix: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    """`sync.log`'s `metrics` as `PREFIX/NAME: float`. A name is letters, digits, `_.-` and `/` between parts, and not
    one ddiloco logs for a learner (`LEARNER_METRICS`); a value is one number as for `loss`. Passed to the session's
    sink as they are, a tensor would be written as the string "tensor(1.5000)" (TensorBoard drops it) and any name would
    be taken."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers, got a {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"metric name {name!r} is invalid: expected letters, digits, '_', '.', '-' and '/' "
                             "between parts (e.g. 'acc' or 'grad/norm')")
        if name in LEARNER_METRICS:
            raise ValueError(f"metric name {name!r} is ddiloco's own ({prefix}/{name}): pass the loss as "
                             "sync.step(tokens, loss=...), or give the metric another name")
        out[f"{prefix}/{name}"] = _scalar(name, value, _METRIC)
    return out


def check_tokens_bound(tokens: int, bound: int) -> None:
    """Raise ValueError when one inner step counts more `tokens` than the run's `max_tokens_per_step` (`bound`): the
    syncer would reject every update that carries it as bad_counters."""
    if tokens > bound:
        raise ValueError(f"tokens={tokens} is more than one inner step may count: the run's max_tokens_per_step is "
                         f"{bound}, and the syncer rejects an update that counts more (bad_counters). Pass the tokens "
                         "(or samples) of this step's batch; a run whose steps count more needs a larger "
                         "--max-tokens-per-step (QuorumConfig.max_tokens_per_step)")
