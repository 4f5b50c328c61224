"""What `sync.step(tokens, loss=...)` accepts beyond `SessionLifecycle._check_step` (inside the session, within the
budget, `tokens` an integer >= 0): a `loss` that is one number, and `tokens` within what the syncer accepts.

Both are checked before the inner step counts, so that a bad value is an error naming it in the user's loop, not
torch's message after the step went out ("only one element tensors can be converted to Python scalars") or an
update the syncer rejects as bad_counters at every round while the loop trains on.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ddiloco.checks import invalid

_LOSS = "one number (the step's loss: a float, or a tensor of one element: loss.item())"


def step_loss(loss: Any) -> float | None:
    """`loss` as a float (None stays None): a Python or numpy number, or a tensor or array of one element (read
    without its autograd graph). A bool, a string or several values raise, naming it."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"loss=<a tensor of shape {tuple(loss.shape)}> is invalid: expected {_LOSS}")
        return float(loss.detach())
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return float(loss)
    size = getattr(loss, "size", None)
    if callable(getattr(loss, "item", None)) and isinstance(size, int) and loss.dtype.kind in "iuf":  # numpy
        if size != 1:
            raise ValueError(f"loss=<an array of shape {tuple(loss.shape)}> is invalid: expected {_LOSS}")
        return float(loss.item())
    raise TypeError(f"{invalid('loss', loss, _LOSS)}, got a {type(loss).__name__}")


def check_tokens_bound(tokens: int, bound: int) -> None:
    """Raise ValueError when one inner step counts more `tokens` than the run's `max_tokens_per_step` (`bound`): the
    syncer would reject every update that carries it as bad_counters."""
    if tokens > bound:
        raise ValueError(f"tokens={tokens} is more than one inner step may count: the run's max_tokens_per_step is "
                         f"{bound}, and the syncer rejects an update that counts more (bad_counters). Pass the tokens "
                         "(or samples) of this step's batch; a run whose steps count more needs a larger "
                         "--max-tokens-per-step (QuorumConfig.max_tokens_per_step)")
