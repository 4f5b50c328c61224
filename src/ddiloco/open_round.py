"""One open round of one fragment in the syncer core: the updates it holds, and the round they merge to.

A round holds at most one update per learner. Another from the same learner either continues the same work (the
same base version, more steps: it replaces the held one) or is new work from a newer version while a late update
of that learner is still held (the newer version overwrote the learner's fragment, so the two cover different
steps): the round then counts both as one participant, whose `folded` names the earlier update. Every other overlap
is refused before it gets here (`ddiloco.admission`).

Updates are summed as they arrive (`ddiloco.round_sum`). When the round closes (`OpenRound.record`) its updates get
their merge weights (tokens^2 / steps, discounted for staleness, capped: `ddiloco.merge`); a round whose running sums
no longer hold exactly its updates with those weights (an update replaced or folded, a weight lowered by the cap) is
summed again from the held payloads, in the same arrival order. When a round closes, and what closing it changes,
are the syncer core's (`ddiloco.syncer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ddiloco.codec_interface import Codec
from ddiloco.config import QuorumConfig
from ddiloco.kernel_threads import INLINE, KernelThreads
from ddiloco.merge import cap_weights, period_share, token_weight
from ddiloco.messages import DecodedTensor, Participant, RejectReason, RoundRecord, Update
from ddiloco.round_sum import RoundSum
from ddiloco.update_values import decode_payload, float_values, l2_norm


@dataclass(frozen=True)
class FragmentMerge:
    """How the updates of one fragment are decoded and summed: what every round of that fragment shares."""

    names: tuple[str, ...]
    """The fragment's tensors (`FragmentPlan.fragments`), in the order they are decoded and summed."""
    shapes: Mapping[str, tuple[int, ...]]
    """Tensor name -> shape, of the whole model."""
    codec: Codec
    """The wire codec of the learners' updates (`DilocoConfig.codec`)."""
    method: str
    """`DilocoConfig.merge`."""
    embeddings: frozenset[str]
    """The tensors merged by plain weighted mean (`FragmentPlan.embeddings`)."""
    threads: KernelThreads = INLINE
    """Where the sums' passes run (`ddiloco.kernels`)."""

    def decode(self, update: Update) -> Mapping[str, DecodedTensor] | tuple[RejectReason, str]:
        """The update's tensors decoded and checked: by the wire layer already (`Update.decoded`), or here."""
        if update.decoded is not None:
            assert sorted(update.decoded) == sorted(update.payload), "the wire layer decodes every tensor it passes"
            return update.decoded
        return decode_payload(self.codec, update.payload, self.names, self.shapes, threads=self.threads)

    def decode_chain(self, payloads: Sequence[Mapping[str, bytes]]) -> dict[str, DecodedTensor]:
        """A held update's values again from its payloads (each checked when it arrived), a folded one's summed."""
        if len(payloads) == 1:  # the update as it arrived (int4: read in place again)
            decoded = decode_payload(self.codec, payloads[0], self.names, self.shapes, threads=self.threads)
            assert not isinstance(decoded, tuple), "payloads are held only once checked"
            return decoded
        total: dict[str, torch.Tensor] = {}
        for payload in payloads:
            decoded = decode_payload(self.codec, payload, self.names, self.shapes, threads=self.threads)
            assert not isinstance(decoded, tuple), "payloads are held only once checked"
            values = {name: float_values(t.values).view(self.shapes[name]) for name, t in decoded.items()}
            total = {name: total[name] + v if total else v for name, v in values.items()}
        # A folded sum of finite values can still overflow: its norm is then inf, and the round does not commit.
        return {name: DecodedTensor(values, l2_norm(values, self.threads)) for name, values in total.items()}

    def new_sum(self, cap: float | None = None) -> RoundSum:
        return RoundSum(self.names, method=self.method, embeddings=self.embeddings, threads=self.threads, cap=cap)


@dataclass
class PendingUpdate:
    """An accepted update held in an open round."""

    payloads: tuple[Mapping[str, bytes], ...]
    """The update's encoded tensors; with a late update folded in, the held one's first. Kept (at int4 an eighth of
    the decoded float32 values) so that a round can be summed again (`OpenRound.record`)."""
    base_version: int
    steps: int
    tokens: int
    inner_step: int
    final: bool = False
    folded: tuple[tuple[int, int], ...] = ()
    """(base_version, inner_step) of the same learner's earlier updates this one includes."""
    arrived_at: float = 0.0
    """When the newest of its updates reached the syncer."""
    join: int = 0
    """The learner's join count (`LearnerInfo.joins`) when it arrived: a later join means the learner came back."""


def merge_weight(pending: PendingUpdate, version: int, staleness_discount: float) -> float:
    """A participant's weight before the cap, in a round of a fragment at `version`: tokens^2 / steps, divided by
    (1 + staleness)^e for a late update (`QuorumConfig.staleness_discount`). The fragment's version does not change
    while its round is open, so the weight an update gets on arrival is the one its round closes with."""
    weight = token_weight(pending.tokens, pending.steps)
    staleness = version - pending.base_version
    if staleness > 0 and staleness_discount:
        weight /= (1.0 + staleness) ** staleness_discount
    return weight


def _combined(held: PendingUpdate, pending: PendingUpdate) -> PendingUpdate:
    """`pending`, arriving while `held` (the same learner's) waits in the round, as the one update the round keeps."""
    folded = (*held.folded, (held.base_version, held.inner_step))
    if held.base_version < pending.base_version:
        # A late update still held, and new work from the next version (which overwrote the learner's
        # fragment, so the two cover different steps): the round counts both, as one.
        return PendingUpdate((*held.payloads, *pending.payloads), pending.base_version, held.steps + pending.steps,
                             held.tokens + pending.tokens, pending.inner_step, pending.final, folded,
                             pending.arrived_at, pending.join)
    # The same base: the same work continued (a pseudo-gradient is measured from the base), so it
    # replaces the held one. Admission refused every other overlap.
    return dataclasses.replace(pending, folded=folded)


@dataclass
class OpenRound:
    """The round of one fragment that collects updates now."""

    merge: FragmentMerge
    updates: dict[int, PendingUpdate] = field(default_factory=dict)
    """learner_id -> its update, in arrival order: the order of the round's sums."""
    first_at: float | None = None
    quorum_at: float | None = None
    close_at: float | None = None
    grace_s: float = 0.0
    rejections: list[tuple[int, str]] = field(default_factory=list)
    summed: RoundSum | None = None
    """The round's running sums (`ddiloco.round_sum`), from its first update on."""
    cap: float | None = None
    """The most norm an update counts with in this round, over the fragment's tensors (`QuorumConfig.max_norm_ratio`
    times the fragment's reference norm when the round opened); None: no cap."""
    reference_norm: float | None = None
    """Set by `record`: the reference norm the round leaves for the next (`RoundSum.reference_norm`)."""
    capped: list[tuple[int, float]] = field(default_factory=list)
    """Set by `record`: (learner_id, norm) of each update that counted with a capped norm."""

    def hold(self, learner_id: int, pending: PendingUpdate, decoded: Mapping[str, DecodedTensor],
             weight: float) -> None:
        """Hold `pending` (its values `decoded`, its merge weight `weight`) for `learner_id`: added to the sums, or
        combined with the update of that learner held already (the sums are then summed again at the close)."""
        if self.summed is None:
            self.summed = self.merge.new_sum(self.cap)
        held = self.updates.get(learner_id)
        if held is None:
            self.summed.add(learner_id, decoded, weight)
        else:
            pending = _combined(held, pending)
            self.summed.invalidate()  # the sums hold the replaced update: the round is summed again at its close
        self.updates[learner_id] = pending

    def record(self, *, fragment: int, version: int, round_index: int, now: float, quorum: QuorumConfig,
               sync_every: int) -> RoundRecord:
        """The round of `fragment`, at `version`, closed at `now`: its participants by learner id, their capped
        weights, and the merged pseudo-gradient, scaled down when the round holds less than an outer step
        (`ddiloco.merge.period_share`) after the fragment's first round. Drops the running sums."""
        summed_ids = list(self.updates)  # arrival order: the order of the round's sums
        raw = [merge_weight(u, version, quorum.staleness_discount) for u in self.updates.values()]
        capped = dict(zip(summed_ids, cap_weights(raw, quorum.max_weight_ratio), strict=True))
        merged = self._merged(summed_ids, [capped[i] for i in summed_ids])
        learner_ids = sorted(self.updates)
        pending = [self.updates[i] for i in learner_ids]
        # A fragment's first round is never scaled, even one of last work: with H at or above the learners' budget
        # it carries the whole run (scaled, the global model kept 40 / 1000 of 40 steps' training).
        share = period_share([(u.steps, u.tokens, u.final) for u in pending], sync_every) if version else 1.0
        if share < 1.0:
            merged = {name: delta * share for name, delta in merged.items()}
        participants = tuple(
            Participant(i, u.base_version, version - u.base_version, u.steps, u.tokens, capped[i], u.inner_step,
                        u.folded)
            for i, u in zip(learner_ids, pending, strict=True))
        assert self.quorum_at is not None
        # A round closed by late updates alone (everyone alive had reported) opened when its quorum was met.
        opened_at = self.quorum_at if self.first_at is None else self.first_at
        return RoundRecord(
            round_index=round_index, fragment=fragment, version=version + 1,
            participants=participants, merged=merged, opened_at=opened_at,
            quorum_at=self.quorum_at, closed_at=now, grace_s=self.grace_s,
            rejections=tuple(self.rejections), summed=tuple(summed_ids))

    def _merged(self, summed_ids: list[int], weights: list[float]) -> dict[str, torch.Tensor]:
        """The round's merge with these (capped) weights, summed in the order its updates arrived: its running sums
        when they hold exactly that, else summed again from the held payloads (a held update was replaced or
        folded, or the cap lowered a weight; the sums used the weights as they arrived)."""
        summed = self.summed
        if summed is None or not summed.holds(summed_ids, weights):
            summed = self.merge.new_sum(self.cap)
            for learner_id, weight in zip(summed_ids, weights, strict=True):
                summed.add(learner_id, self.merge.decode_chain(self.updates[learner_id].payloads), weight)
        self.summed = None
        self.reference_norm, self.capped = summed.reference_norm(), summed.capped
        return summed.result(self.merge.shapes)
