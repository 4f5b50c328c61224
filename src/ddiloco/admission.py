"""The syncer core's admission: what it knows of each learner, and which joins and updates it refuses.

A join is refused (`Admission.join_refusal`) when the learner could not take part: another schema version,
algorithm config or model than the syncer's, or a learner id or token limit out of range. An update is rejected
(`Admission.update_problem`) when it cannot be merged: from a learner that has not joined, while the round log
cannot be written, for no fragment or with other tensors or codec than the fragment's, with counters that do not
add up (its tokens bound its merge weight, so they are bounded too), or overlapping work already merged or held.

The rule for late updates: an update that arrives after its round closed goes into the next round of that
fragment, with staleness = current version - base version, as long as staleness <= max_staleness and its base is
newer than the base of the same learner's last merged update for that fragment (a learner that missed a broadcast
and publishes twice from the same base would otherwise be counted twice). Anything else is rejected with a
recorded reason; every update is merged or rejected.

Checks only: they read the state passed in and change nothing. The syncer core (`ddiloco.syncer`) keeps the
`LearnerInfo`s, records each refusal and answers it; the runtime refuses some joins before the core sees them
(`ddiloco.runtime.syncer_admission`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.fragments import FragmentPlan
from ddiloco.messages import SCHEMA_VERSION, Join, ModelSpec, RejectReason, Update
from ddiloco.open_round import OpenRound


@dataclass
class LearnerInfo:
    """What the syncer knows of one learner."""

    alive: bool
    last_seen: float
    merged_base: dict[int, int] = field(default_factory=dict)
    """fragment -> base version of this learner's last merged update for it. A later update from
    the same or an older base would count the same progress twice."""
    last_update: tuple[float, int] | None = None
    """(arrival time, inner step) of its previous accepted update, for the step-time estimate (a rejected one is not
    timed)."""
    accepted: int = 0
    rejected: int = 0
    tokens_merged: int = 0
    joins: int = 0
    declared_tokens_per_step: int = 0
    """The most tokens per inner step it declared at its last join (0: none, the run's limit applies)."""
    last_progress: float = 0.0
    """When it last sent an update that counts as progress (accepted, or refused only because rounds could not be
    written), or joined: a live learner without one for `Syncer.progress_bound()` seconds is `stalled`."""
    stalled: bool = False
    """It is alive but sends no updates: it does not count in the quorum until its next update."""
    held: dict[int, tuple[int, float]] = field(default_factory=dict)
    """fragment -> (the version its last round made, seconds from this learner's on-time update's arrival to that
    round's close): what the syncer held it, to take from the result delay its next update reports."""
    step_time_s: float | None = None
    """Moving average of this learner's own step time (seconds per inner step between two of its updates), for
    the margins a round's result reports (`Syncer._margins`)."""
    path_time_s: float | None = None
    """Moving average of this learner's own path time (`Syncer._observe_path_time`): its upload, the merge, its
    download and the latency both ways. Reported per learner (`syncer_status.json`), so a far or slow link shows."""


class Admission:
    """The syncer's checks on what learners send it. See the module docstring."""

    def __init__(self, config: DilocoConfig, quorum: QuorumConfig, *, spec: ModelSpec, plan: FragmentPlan) -> None:
        """`spec`: the model as the syncer holds it; `plan`: its fragments."""
        self.config = config
        self.quorum = quorum
        self.spec = spec
        self.plan = plan

    def join_refusal(self, join: Join) -> str | None:
        """Why `join` is refused, or None."""
        refusal = None
        if join.schema_version != SCHEMA_VERSION:
            refusal = f"schema version {join.schema_version}, but the syncer speaks {SCHEMA_VERSION}"
        elif join.config_fingerprint != self.config.fingerprint():
            refusal = (f"algorithm config differs (fingerprint {join.config_fingerprint}, syncer has "
                       f"{self.config.fingerprint()}): start every learner with the syncer's config")
        elif (diff := self.spec.difference(join.model_spec)) is not None:
            refusal = f"model differs from the syncer's: {diff}"
        elif join.learner_id < 0:
            refusal = f"learner_id={join.learner_id} is invalid: expected an integer >= 0"
        elif join.max_tokens_per_step < 0:
            refusal = f"max_tokens_per_step={join.max_tokens_per_step} is invalid: expected an integer >= 0 (0: none)"
        elif join.max_tokens_per_step > self.quorum.max_tokens_per_step:
            refusal = (f"learner {join.learner_id} declares up to {join.max_tokens_per_step} tokens per inner step, "
                       f"but the run allows at most {self.quorum.max_tokens_per_step} (max_tokens_per_step): "
                       "declare the learner's real batch, or start the syncer with a larger --max-tokens-per-step")
        return refusal

    def update_problem(self, update: Update, info: LearnerInfo | None, *, storage_error: str | None,
                       versions: Sequence[int], rounds: Sequence[OpenRound]) -> tuple[RejectReason, str] | None:
        """Why `update` is rejected, or None. `info`: what the syncer knows of its learner (None: nothing);
        `storage_error`: why rounds cannot be made durable, while updates are refused for it; `versions` and
        `rounds`: each fragment's version and open round."""
        if info is None or not info.alive:
            return RejectReason.UNKNOWN_LEARNER, "join first"
        if storage_error is not None:
            return RejectReason.UNAVAILABLE, f"{storage_error}; retrying"
        p = update.fragment
        if not 0 <= p < self.plan.num_fragments:
            return RejectReason.BAD_FRAGMENT, f"fragment {p} outside 0..{self.plan.num_fragments - 1}"
        if update.codec != self.config.codec:
            return RejectReason.WRONG_CODEC, f"codec {update.codec!r}, expected {self.config.codec!r}"
        expected = self.plan.fragments[p]
        if sorted(update.payload) != sorted(expected):
            return RejectReason.WRONG_TENSORS, f"fragment {p} holds {len(expected)} tensors, got other names"
        if update.steps < 1 or update.tokens < 0 or update.inner_step < update.steps:
            return RejectReason.BAD_COUNTERS, (f"steps={update.steps} tokens={update.tokens} "
                                               f"inner_step={update.inner_step}")
        for name, seconds in (("step_time_s", update.step_time_s), ("result_delay_s", update.result_delay_s)):
            if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
                return RejectReason.BAD_COUNTERS, f"{name}={seconds}: expected seconds >= 0"
        per_step = info.declared_tokens_per_step or self.quorum.max_tokens_per_step
        if update.tokens > update.steps * per_step:
            # The merge weight is tokens^2 / steps: a count nobody bounds is a weight nobody bounds.
            whose = (f"learner {update.learner_id} declared" if info.declared_tokens_per_step
                     else "the run allows (max_tokens_per_step)")
            return RejectReason.BAD_COUNTERS, (f"tokens={update.tokens} in steps={update.steps} is more than the "
                                               f"{per_step} tokens per inner step {whose}")
        version = versions[p]
        if not 0 <= update.base_version <= version:
            return RejectReason.BAD_COUNTERS, f"base_version {update.base_version}, fragment is at {version}"
        staleness = version - update.base_version
        if staleness > self.quorum.max_staleness:
            return RejectReason.STALE, f"{staleness} versions behind (max {self.quorum.max_staleness})"
        merged_base = info.merged_base.get(p, -1)
        if update.base_version <= merged_base:
            return RejectReason.STALE, (f"base version {update.base_version} overlaps this learner's update "
                                        f"from base version {merged_base}, already merged")
        held = rounds[p].updates.get(update.learner_id)
        if held is not None and (update.base_version < held.base_version
                                 or (update.base_version == held.base_version and update.steps <= held.steps)):
            return RejectReason.DUPLICATE, f"already holds an update of this learner for fragment {p}"
        return None
