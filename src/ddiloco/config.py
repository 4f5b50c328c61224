"""Configuration of the Decoupled DiLoCo algorithm: plain, frozen, validated data.

`DilocoConfig` is what every learner and the syncer must agree on (its fingerprint is checked when a
learner joins). `QuorumConfig` is the syncer's own policy for closing rounds, and `LearnerConfig` the
drivers' policy for a learner that waits on the syncer. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ddiloco.checks import require, require_choice, require_int

FRAGMENT_STRATEGIES = ("balanced", "strided", "single")
MERGE_METHODS = ("rda", "mean")
GRACE_MODES = ("adaptive", "fixed", "none")
CODEC_CHOICES = ("fp32", "bf16", "fp8", "int8", "int4", "int2")
DOWNLINK_CODEC_CHOICES = ("fp32", "int8", "int4")
DEFAULT_DOWNLINK_CODEC = "int8"
DEFAULT_MAX_TOKENS_PER_STEP = 2**24
"""16,777,216 tokens: at least the largest per-step batch published for LLM pre-training (Llama 3 405B ends at
16 M tokens per step), so no honest learner is held back; an operator who knows the run's batch sets less."""
DEFAULT_MAX_NORM_RATIO = 10.0
"""An update counts with at most 10 times the norm its fragment's previous round had. In a healthy harness run
(`quality`'s workload, 896 steps, 5 % jitter; docs/protocol.md, "An update's norm") the largest ratio was 1.94 once
a fragment had two rounds behind it (7.30 against its first round, which is never a reference)."""
DEFAULT_MAX_WEIGHT_RATIO = 16.0
"""A learner may weigh up to 16 times the mean of a round's other participants. The weight tokens^2 / steps is
steps x (tokens per step)^2: honest rounds of one batch size reached 11 (real runtime: 33 inner steps beside two
learners' 3) and a learner with twice the batch weighs 4 times as much. With n participants no share exceeds
16 / (15 + n): 0.94 of 2, 0.84 of 4, 0.70 of 8 (docs/protocol.md, "Merge weights")."""
DEFAULT_PROGRESS_TIMEOUT_S = 600.0
"""Ten minutes: ten times the longest gap a healthy learner showed between its accepted updates in 212 real runs on
this machine (60.3 s, a learner of a K = M run waiting out `--max-wait-s` while another was paused; 58.7 s from a
join to the first update of a 50 M-parameter model), and room for a first step's compilation. Measured with
`benchmarks/bench_update_gaps.py` (docs/protocol.md, "A learner alive without updates")."""
DEFAULT_CONNECT_TIMEOUT_S = 120.0
"""How long a learner that has never reached its syncer keeps trying: far longer than a syncer takes to start
(imports, restore) or restart, short enough that a wrong address ends in an error within minutes."""


@dataclass(frozen=True, kw_only=True)
class DilocoConfig:
    """The algorithm. Learners and syncer must hold identical copies (checked at join)."""

    num_fragments: int = 4
    """P: how many fragments the model is cut into; round r syncs fragment r mod P."""
    sync_every: int = 16
    """H, in inner steps: every fragment is synchronised once per H inner steps. 16 won the sweep at this
    project's scales (docs/results.md, "Defaults and rounds"); the paper's 12B runs use P = H = 24."""
    overlap_steps: int = 3
    """tau, in inner steps: a learner may train this many inner steps after publishing a fragment
    before it must hold a newer version of that fragment (it waits at that point, see LearnerConfig). 3 (was 2)
    leaves room for the adaptive grace window's two steps (`QuorumConfig.grace_max_steps`) and a margin for the
    estimates' error, so the first learner of a round does not wait for its result (docs/results.md, "Defaults and
    rounds", item 6)."""
    keep_overlap_work: bool = True
    """What a learner does with the inner steps it trained on a fragment after publishing it (at most tau,
    or more if it stopped waiting) when the round's result arrives: True keeps them, on top of the new global
    value (local <- new + (local - local at publish)), and publishes them in its next update; False overwrites
    them, as the paper's learners do (alpha = 0 in Streaming DiLoCo), losing about tau / H of every
    fragment's work. Harness, 4 learners x 896 inner steps (`ddiloco experiment quality`'s run): 1.8202 -> 1.8069
    (data-parallel 1.7799); at 400 steps 2.1013 -> 2.1099, inside that length's noise (docs/results.md)."""
    round_margin_steps: float = 1.5
    """Inner steps of the grace window an on-time learner keeps in hand: a round's result reports how much of the
    window was left, in each on-time learner's own step time, when its update arrived (`FragmentDelta.margins`;
    a window shorter than this + 0.5 average steps counts as that long, `Syncer._margins`), and a learner with less
    moves its schedule ahead by the difference, before it is late. 0: off, a learner moves only once late. With
    1.5 (the default) K = 1 + grace passed K = M on the harness's 18 % straggler set-up, where it was 1.3 % behind
    with 0 (docs/results.md, "Defaults and rounds", item 7)."""
    round_margin_gain: float = 0.0
    """How fast a learner learns a steady move from its margins (`RoundSchedule.keep_margin`): after each round it
    published for, its drift (inner steps its schedule moves ahead with every such result) grows by this times what
    its margin fell short of `round_margin_steps` (a late update counts as no margin) and shrinks by this times any
    margin beyond it, within 0 and what its own pace lacks of the rounds' (`RoundSchedule.drift_limit`). The margin
    move alone leaves a learner d steps per round slower than the clock-setting learners d short of its margin; the
    drift moves it those d steps every round. 0 (the default): no drift. 0.25 gained 0.7-1.9 % in the harness with
    two learners 36 % slower and brought a real straggler's missed rounds from a third to 4-11 %, but on real
    learners of equal speed it pulled the rounds forward (`ddiloco run`: 218 rounds instead of 164, a third more
    bytes), so it is off by default (docs/results.md, "Defaults and rounds", item 9)."""
    pace_rounds: bool = False
    """Whether a learner slower than the rounds publishes after fewer of its own inner steps
    (`RoundSchedule.round_pace`, Dynamic Local Updates) and moves back when it leads the rounds
    (`Learner._follow_close`). Off by default: since every learner follows the rounds' close exactly it no longer
    beats the default in the harness (2 slow learners in 4: 2.3433 paced, 2.3466 not; K = M 2.2605), and on real
    processes of equal speed on a loaded machine the pace opened more rounds (docs/results.md)."""
    fragment_strategy: str = "balanced"
    """How tensors are dealt into fragments: balanced (bin-packed by bytes), strided (transformer block i to fragment
    i mod P, blocks found as `blocks.i.`, `layers.i.`, `layer.i.` or `h.i.` in the names; the rest bin-packed),
    single."""
    embedding_pattern: str = ""
    """Embedding tensors are merged with the plain weighted mean, because they are not near-orthogonal
    across learners. Empty (the default): they are the weights of the model's `nn.Embedding` modules,
    whatever their names. Otherwise a regular expression (re.search on the parameter name) that
    chooses them instead, for embeddings that are not `nn.Embedding` modules."""
    merge: str = "rda"
    """rda (radial-directional averaging, embeddings by weighted mean) or mean (weighted mean)."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate (DiLoCo's value; the paper does not publish its own)."""
    outer_momentum: float = 0.5
    """Outer Nesterov momentum. DiLoCo's 0.9 lost to 0.5 in every sweep here (docs/results.md, "Defaults and rounds"):
    its momentum needs many outer steps to pay off, and it amplifies every partial round."""
    codec: str = "int4"
    """Wire codec of the pseudo-gradients sent by learners (fp32, bf16, fp8, int8, int4, int2)."""
    downlink_codec: str = DEFAULT_DOWNLINK_CODEC
    """Codec of the merged fragments the syncer broadcasts after a round (fp32, int8, int4). fp32 sends
    the exact global value; int8 and int4 send its change, with error feedback, from which the syncer and
    every learner rebuild the same global value bit for bit (`ddiloco.downlink`). Joins always get fp32."""

    def __post_init__(self) -> None:
        require(isinstance(self.num_fragments, int) and self.num_fragments >= 1,
                 "num_fragments", self.num_fragments, "an integer >= 1")
        require(isinstance(self.sync_every, int) and self.sync_every >= 1,
                 "sync_every", self.sync_every, "an integer >= 1 (inner steps)")
        require(isinstance(self.overlap_steps, int) and self.overlap_steps >= 0,
                 "overlap_steps", self.overlap_steps, "an integer >= 0 (inner steps)")
        require(isinstance(self.keep_overlap_work, bool), "keep_overlap_work", self.keep_overlap_work,
                 "true or false")
        require(isinstance(self.round_margin_steps, int | float) and math.isfinite(self.round_margin_steps)
                and self.round_margin_steps >= 0, "round_margin_steps", self.round_margin_steps,
                "a finite number >= 0 (inner steps)")
        require(isinstance(self.round_margin_gain, int | float) and math.isfinite(self.round_margin_gain)
                and 0 <= self.round_margin_gain <= 1, "round_margin_gain", self.round_margin_gain,
                "a number from 0 to 1")
        require(isinstance(self.pace_rounds, bool), "pace_rounds", self.pace_rounds, "true or false")
        require_choice("fragment_strategy", self.fragment_strategy, FRAGMENT_STRATEGIES)
        require_choice("merge", self.merge, MERGE_METHODS)
        require_choice("codec", self.codec, CODEC_CHOICES)
        require_choice("downlink_codec", self.downlink_codec, DOWNLINK_CODEC_CHOICES)
        try:
            re.compile(self.embedding_pattern)
        except re.error as exc:
            raise ValueError(f"embedding_pattern={self.embedding_pattern!r} is not a valid "
                             f"regular expression: {exc}") from None
        require(math.isfinite(self.outer_lr) and self.outer_lr > 0, "outer_lr", self.outer_lr,
                 "a finite number > 0")
        require(0 <= self.outer_momentum < 1, "outer_momentum", self.outer_momentum, "0 <= value < 1")
        if self.fragment_strategy == "single" and self.num_fragments != 1:
            raise ValueError(f"fragment_strategy='single' needs num_fragments=1, got {self.num_fragments}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A short hash of every field: two parties with different algorithms must not mix updates."""
        return _hash(self.to_dict())

    def fingerprints(self) -> tuple[str, ...]:
        """`fingerprint()`, then those the versions before its newest fields (`FIELDS_ADDED`) computed for the same
        algorithm, where those fields hold what runs of then trained with: a syncer state saved by one of them resumes.
        Its hash held none of them, and was refused as "a different algorithm config" (an upgrade probe, 2026-12-07)."""
        fields, found = self.to_dict(), [self.fingerprint()]
        for name, value_before in reversed(FIELDS_ADDED):
            if fields.pop(name) != value_before:
                break
            found.append(_hash(fields))
        return tuple(found)


FIELDS_ADDED: tuple[tuple[str, Any], ...] = (("round_margin_steps", 0.0), ("round_margin_gain", 0.0))
"""`DilocoConfig` fields added after runs were saved, oldest first, each with the value that does what the versions
before it did (`fingerprints`; `run_config._SAVED_BEFORE` reads such a run's config with them): the round margins
(2026-12-02) and their drift (2026-12-03)."""


def _hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class QuorumConfig:
    """The syncer's own policy: when it closes a round, and how much one learner may count in it."""

    min_quorum: int = 1
    """K: a round may close once this many learners have reported (capped at the learners alive,
    so a quorum larger than the live learners never deadlocks)."""
    grace: str = "adaptive"
    """adaptive: clip(gamma * (tau * step_time - quorum_time - sync_time), grace_min_steps * step_time, cap *
    step_time) with moving averages, cap = min(grace_max_steps, max(1, tau - 1)), both bounds at least 10 ms;
    fixed: grace_s; none: close as soon as the quorum is present."""
    grace_s: float = 0.0
    """Grace window in seconds for grace='fixed'."""
    grace_gamma: float = 1.0
    """gamma: safety factor on the slack of the adaptive grace window."""
    grace_max_steps: float = 2.0
    """The adaptive grace window's cap, in step times, and never above tau - 1 (at least 1: a run with tau = 2 keeps
    the paper's one step, since a window as long as the whole slack makes the first learner wait whenever the
    estimates are off: 98.2 % goodput in the harness's heterogeneous set-up). With the paper's one-step cap, on real
    processes of equal speed (4 learners on 2 cores), 20-26 % of the updates missed their round, by a median
    0.05-0.09 s and at most 0.31 s (about one step) after the close. Two steps, with tau = 3 so that no learner
    waits, leave 8-10 % of them late, and trained better at 300 steps (at 896, within the runs' spread; docs/results.md,
    "Defaults and rounds", item 6)."""
    grace_min_steps: float = 0.25
    """The adaptive grace window's floor, in step times, once a step time is estimated (and never above the cap):
    updates that arrive within a quarter step of the quorum join its round even where the overlap leaves no slack,
    as with tau = 0, where every learner waits for its result, or a sync slower than tau steps. Without it, tau = 0
    and K = 1 closed every round on its first update and merged the others one version late (harness, learners
    in lockstep, 128 inner steps: 2.7049 against 2.4563 with it, the defaults' tau = 3 2.4534; docs/results.md,
    "Defaults and rounds", item 16). Never under 10 ms (`ddiloco.round_timing.MIN_GRACE_S`, the cap lifted with
    it): learners of a model with 1 ms steps arrive milliseconds apart, and 4 of them trained to 0.04-1.0 against
    their plain loops' 0.0001 with a quarter step (item 19). 0: no floor, in seconds either."""
    estimate_decay: float = 0.8
    """Weight of the old value in the exponential moving averages of step, quorum and sync times."""
    max_staleness: int = 4
    """An update whose base version is more than this many versions behind the fragment is rejected."""
    heartbeat_timeout_s: float = 30.0
    """A learner silent for longer than this is treated as gone and never waited for."""
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S
    """A live learner that has sent no update for this long (since its last one, or its join) stops counting in the
    quorum, and rounds no longer wait for it, until its next update: a loop that hangs while its heartbeat thread
    runs, or a learner that only heartbeats, held every round of a K = M run open for as long as it lived. Where
    `ddiloco.liveness.STALL_PERIODS` sync periods (sync_every x the run's step time) are longer, they are the
    bound. 0: off."""
    max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP
    """Tokens (or samples) one inner step may count, at most: a learner declaring more at join is refused, and an
    update with more tokens than steps x this (or than the learner's own, smaller declaration) is rejected as
    bad_counters. The merge weight is tokens^2 / steps, so without a bound it is whatever a learner claims."""
    staleness_discount: float = 0.0
    """e: a participant s versions stale (a late update held for the next round) weighs its token weight divided by
    (1 + s)^e; 0 (the default) weighs it as a fresh one. Its pseudo-gradient was measured from an older base, and
    the outer momentum amplifies it. Harness, 2 of 4 learners 18 % slower (`benchmarks/bench_heterogeneous.py`):
    e = 2 measured in docs/results.md ("Defaults and rounds", item 4); not measured on learners of equal speed,
    hence off by default."""
    max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO
    """The most one learner's merge weight may be, as a multiple of the mean weight of the round's other
    participants (`merge.cap_weights`); a heavier one is lowered to it. 1 makes every round an equal average."""
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO
    """The largest norm one update counts with in a round (over its fragment's tensors), as a multiple of the
    fragment's reference norm: the mean norm of its previous round's updates that were not capped. A larger one
    counts as if scaled down to it (`ddiloco.round_sum`), so a learner whose parameters were corrupted (a flipped bit
    in memory: a value of 1e30) or that diverged moves the global model by no more than an ordinary round would. No
    cap in a fragment's first two rounds (the first covers a few warm-up steps: no reference), nor in the first
    round after the syncer restarted, nor against a reference of 0. 0: no cap."""

    def __post_init__(self) -> None:
        require(isinstance(self.min_quorum, int) and self.min_quorum >= 1, "min_quorum",
                 self.min_quorum, "an integer >= 1")
        require_choice("grace", self.grace, GRACE_MODES)
        require(math.isfinite(self.grace_s) and self.grace_s >= 0, "grace_s", self.grace_s,
                 "a finite number >= 0 (seconds)")
        require(math.isfinite(self.grace_gamma) and self.grace_gamma >= 0, "grace_gamma",
                 self.grace_gamma, "a finite number >= 0")
        require(isinstance(self.grace_max_steps, int | float) and math.isfinite(self.grace_max_steps)
                and self.grace_max_steps >= 0, "grace_max_steps", self.grace_max_steps,
                "a finite number >= 0 (step times)")
        require(isinstance(self.grace_min_steps, int | float) and math.isfinite(self.grace_min_steps)
                and self.grace_min_steps >= 0, "grace_min_steps", self.grace_min_steps,
                "a finite number >= 0 (step times)")
        require(0 <= self.estimate_decay < 1, "estimate_decay", self.estimate_decay, "0 <= value < 1")
        require(isinstance(self.max_staleness, int) and self.max_staleness >= 0, "max_staleness",
                 self.max_staleness, "an integer >= 0 (versions)")
        require(self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", self.heartbeat_timeout_s,
                 "a number > 0 (seconds)")
        require(isinstance(self.progress_timeout_s, int | float) and not isinstance(self.progress_timeout_s, bool)
                and math.isfinite(self.progress_timeout_s) and self.progress_timeout_s >= 0, "progress_timeout_s",
                self.progress_timeout_s, "a finite number >= 0 (seconds; 0: off)")
        require_int("max_tokens_per_step", self.max_tokens_per_step, minimum=1)
        require(isinstance(self.staleness_discount, int | float) and math.isfinite(self.staleness_discount)
                and self.staleness_discount >= 0, "staleness_discount", self.staleness_discount,
                "a finite number >= 0")
        require(isinstance(self.max_weight_ratio, int | float) and math.isfinite(self.max_weight_ratio)
                 and self.max_weight_ratio >= 1, "max_weight_ratio", self.max_weight_ratio, "a finite number >= 1")
        require(isinstance(self.max_norm_ratio, int | float) and math.isfinite(self.max_norm_ratio)
                and (self.max_norm_ratio >= 1 or self.max_norm_ratio == 0), "max_norm_ratio", self.max_norm_ratio,
                "a finite number >= 1, or 0 for no cap")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """How a learner's driver treats the syncer (the sans-I/O core knows no wall time)."""

    max_wait_s: float = 60.0
    """Longest a learner blocks for a fragment that is overlap_steps overdue; after that it stops
    waiting for that round and trains on (the round's result still overwrites it when it arrives)."""
    heartbeat_every_s: float = 5.0
    """How often an idle learner tells the syncer it is alive."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """Longest a learner process tries a syncer that has never answered it (a wrong address, a syncer that is
    not running) before it exits with an error (code 4); 0: no bound. Once the syncer has answered, the learner
    retries without a bound: a syncer that restarts mid-run comes back on its address."""

    def __post_init__(self) -> None:
        require(self.max_wait_s >= 0, "max_wait_s", self.max_wait_s, "a number >= 0 (seconds)")
        require(self.heartbeat_every_s > 0, "heartbeat_every_s", self.heartbeat_every_s,
                 "a number > 0 (seconds)")
        require(math.isfinite(self.connect_timeout_s) and self.connect_timeout_s >= 0, "connect_timeout_s",
                 self.connect_timeout_s, "a finite number >= 0 (seconds; 0: no bound)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
