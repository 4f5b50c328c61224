"""The downlink rule: how a round's result travels from the syncer to the learners, and what both then hold.

With `DilocoConfig.downlink_codec = "fp32"` the syncer broadcasts the fragment's new global value as it is
(`FragmentState`, float32, exact). With a lossy codec (int8, int4) it sends the fragment's change instead,
and the syncer and every learner agree to hold the value that change rebuilds, not the unrounded result
of the outer step. For fragment p going from version v to v + 1, per tensor, on CPU in float32:

    change   = (new - previous) + residual      new: the outer step's result; previous: the global at v
    payload  = encode(change)                   the downlink codec's bytes (`FragmentDelta.payload`)
    decoded  = decode(payload)
    global   = previous + decoded               the syncer's new global value, and every learner's
    residual = change - decoded                 kept by the syncer for the fragment's next round

A learner holds `previous` bit for bit (it is the value it last received at version v), and rebuilds the
new value with `rebuild_tensor`, the very function and op order the syncer uses, so the two hold identical
bits; `fragment_checksum` (zlib.crc32 of the rebuilt float32 bytes, tensor by tensor in the fragment
plan's order) travels with the change and proves it. The residual is error feedback (Seide et al., 1-bit
SGD, 2014; Karimireddy et al., arXiv 1901.09847): what one round's quantisation does not deliver, the
fragment's next round sends, so no change is lost, only delayed.

A learner that cannot rebuild (it holds another version of the fragment, or the checksum disagrees) joins
again, and the Welcome brings every fragment in float32 (`Learner`); the syncer never resends a change.

Replay: the residuals are part of the syncer's state (`state_dict`), and encoding is deterministic, so a
round log re-applied through the same rule (`Syncer.apply_committed`) rebuilds the global state bit for bit.

This module owns the rule and the residuals. It knows nothing of rounds, learners or transports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ddiloco.checksums import crc32
from ddiloco.codec_interface import Codec, NonFiniteError
from ddiloco.compression import encode_decoded, get_codec
from ddiloco.fragments import FragmentPlan
from ddiloco.kernel_threads import INLINE, KernelThreads
from ddiloco.messages import FragmentDelta, FragmentState
from ddiloco.update_values import DecodeBuffers
from ddiloco.zero_encodings import zero_names

logger = logging.getLogger(__name__)

EXACT_CODEC = "fp32"
"""The downlink codec that sends the global value itself (no change, no residual)."""

Tensors = Mapping[str, torch.Tensor]


def rebuild_tensor(previous: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """previous + decoded on CPU float32, written into `decoded` (the caller's own, just decoded): one tensor's new
    global value, the same bits as the syncer's `torch.add(previous, decoded)` (a float addition is exact to the
    rounding whatever the order of its operands). In place, since a fresh tensor the size of a fragment's costs its
    learner more in page faults than the addition (a receive at 57 M parameters, 2026-12-07)."""
    return decoded.add_(previous.detach().to("cpu", torch.float32))


def fragment_checksum(tensors: Tensors, names: Sequence[str], threads: KernelThreads = INLINE) -> int:
    """zlib.crc32 of the tensors' float32 bytes (C order), one after the other in the order of `names` (on `threads`:
    `ddiloco.checksums`, the same value)."""
    flats = [tensors[name].detach().to("cpu", torch.float32).contiguous().reshape(-1) for name in names]
    return crc32([memoryview(flat.numpy()).cast("B") for flat in flats], threads)


def rebuild(delta: FragmentDelta, previous: Tensors, names: Sequence[str],
            shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | str:
    """A learner's side: the fragment's new global value from the one it holds at `delta.base_version`
    (`previous`), or why it cannot be had (a payload that does not decode, a checksum that disagrees)."""
    if sorted(delta.payload) != sorted(names):
        return f"the change of fragment {delta.fragment} names other tensors than the fragment's"
    try:
        codec = get_codec(delta.codec)
        values = {name: rebuild_tensor(previous[name], codec.decode(delta.payload[name], shapes[name]))
                  for name in names}
    except ValueError as exc:
        return f"the change of fragment {delta.fragment} does not decode: {exc}"
    checksum = fragment_checksum(values, names)
    if checksum != delta.checksum:
        return (f"fragment {delta.fragment} version {delta.version} rebuilt with checksum {checksum:#010x}, "
                f"the syncer's is {delta.checksum:#010x}")
    return values


class Downlink(Protocol):
    """The syncer's side of the rule. Around each outer step of fragment p:
    `previous = before_step(p, global_p)`, the step, then `after_step(p, version, previous, global_p)`,
    which may rewrite `global_p` in place and returns the message every live learner is sent."""

    def before_step(self, fragment: int, tensors: Tensors) -> dict[str, torch.Tensor] | None: ...

    def after_step(self, fragment: int, version: int, previous: dict[str, torch.Tensor] | None,
                   tensors: Tensors) -> FragmentState | FragmentDelta: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...


class ExactDownlink:
    """fp32: the new global value itself, as computed by the outer step."""

    def before_step(self, fragment: int, tensors: Tensors) -> None:
        return None

    def after_step(self, fragment: int, version: int, previous: None, tensors: Tensors) -> FragmentState:
        # A snapshot: later rounds update the global tensors in place while this one may wait in a link.
        return FragmentState(fragment, version, {name: t.clone() for name, t in tensors.items()})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"an fp32 downlink keeps no residuals, the state holds {len(state)}")


class DeltaDownlink:
    """A lossy codec: the change plus error feedback (see the module docstring); one residual per tensor."""

    def __init__(self, codec_name: str, plan: FragmentPlan, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._codec = get_codec(codec_name)
        self._plan = plan
        self._shapes = dict(shapes)
        self._residual = {name: torch.zeros(shapes[name], dtype=torch.float32)
                          for names in plan.fragments for name in names}
        # previous, change and decoded values live for one step: reused, since a fresh buffer the size of a large
        # tensor costs more in page faults than the arithmetic done in it.
        self._buffers = DecodeBuffers()

    @property
    def codec(self) -> Codec:
        """The downlink codec."""
        return self._codec

    def residual(self, name: str) -> torch.Tensor:
        """Tensor `name`'s residual, itself (the fused close, `ddiloco.fused_close`, updates it in place)."""
        return self._residual[name]

    def _buffer(self, name: str, numel: int | None = None) -> torch.Tensor:
        shape = self._shapes[name]
        return self._buffers.take(math.prod(shape) if numel is None else numel)

    def before_step(self, fragment: int, tensors: Tensors) -> dict[str, torch.Tensor]:
        names = self._plan.fragments[fragment]
        return {name: self._buffer(name)[:tensors[name].numel()].view(self._shapes[name]).copy_(tensors[name])
                for name in names}

    @torch.no_grad()
    def after_step(self, fragment: int, version: int, previous: dict[str, torch.Tensor] | None,
                   tensors: Tensors) -> FragmentState | FragmentDelta:
        assert previous is not None, "before_step first"
        names = self._plan.fragments[fragment]
        changes = {name: torch.sub(tensors[name], previous[name],
                                   out=self._buffer(name)[:tensors[name].numel()].view(self._shapes[name]))
                   .add_(self._residual[name]) for name in names}
        outs = {name: self._buffer(name, self._codec.buffer_numel(tensors[name].numel())) for name in names}
        try:
            # What every learner's decode of the payload gives, computed while encoding (the same bits).
            encoded = {name: encode_decoded(self._codec, changes[name], out=outs[name]) for name in names}
        except NonFiniteError as exc:
            # A change beyond float32 (values near 3e38 that moved by as much again): send the exact value
            # and start the error feedback afresh. Deterministic, so a replay takes the same branch.
            logger.warning("[syncer] fragment %d version %d: the change is not finite (%s); sent in float32",
                           fragment, version, exc)
            for name in names:
                self._residual[name].zero_()
            self._give_back(previous, changes, outs)
            return ExactDownlink().after_step(fragment, version, None, tensors)
        for name in names:
            decoded = encoded[name][1]
            # rebuild_tensor's arithmetic (torch.add of the same operands), written into the global tensor itself.
            torch.add(previous[name], decoded, out=tensors[name])
            torch.sub(changes[name], decoded, out=self._residual[name])
        payload = {name: encoded[name][0] for name in names}
        self._give_back(previous, changes, outs)
        return FragmentDelta(fragment, version, version - 1, self._codec.name, payload,
                             fragment_checksum(tensors, names),
                             zero=zero_names(self._codec, payload, {name: tensors[name].numel() for name in names}))

    def _give_back(self, *buffers: dict[str, torch.Tensor]) -> None:
        for group in buffers:
            self._buffers.give([t.view(-1) for t in group.values()])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self._residual.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if sorted(state) != sorted(self._residual):
            raise ValueError(f"the state holds downlink residuals for {len(state)} tensors, the model has "
                             f"{len(self._residual)} (written with another downlink codec or model?)")
        for name, tensor in state.items():
            self._residual[name] = tensor.detach().to("cpu", torch.float32, copy=True).view(self._shapes[name])


def make_downlink(codec_name: str, plan: FragmentPlan, shapes: Mapping[str, tuple[int, ...]]) -> Downlink:
    """The syncer's downlink for `DilocoConfig.downlink_codec`."""
    if codec_name == EXACT_CODEC:
        return ExactDownlink()
    return DeltaDownlink(codec_name, plan, shapes)
