"""The syncer core's timing of rounds: moving averages, the grace window, and each on-time learner's margin.

Once a round's quorum is present it waits a grace window for stragglers: adaptive, clip(gamma * (tau * step_time -
quorum_time - sync_time), 0, cap) from moving averages of the step, quorum and sync times (`grace_window`); fixed;
or none. A round's result then tells each learner whose update was on time how many of its own inner steps were left
of that window when its update arrived (`round_margins`), from which the learner decides whether to publish earlier
(`DilocoConfig.round_margin_steps`, `Learner._follow_close`).

The run's step time is a moving average of every learner's accepted updates, each sample bounded to within a factor
MAX_STEP_TIME_RATIO of the estimate (`bounded_step_time`): one learner's updates, spaced as it pleases, cannot set every
round's window.

Arithmetic over numbers passed in: the syncer core (`ddiloco.syncer`) keeps the estimates, the rounds and the clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddiloco.config import DilocoConfig, QuorumConfig

MARGIN_HEADROOM_STEPS = 0.5
"""Average step times beyond `DilocoConfig.round_margin_steps` that margins are counted against at the least
(`round_margins`): in a shorter grace window the learner that made the quorum still keeps its margin, and one
that arrived more than this after it moves ahead. At the defaults: a window of at least two steps."""

MAX_STEP_TIME_RATIO = 32.0
"""One sample of the run's step time counts as at most this many times the current estimate and at least its inverse
times it (`bounded_step_time`). A learner chooses when it sends and which inner step it names: unbounded, one update
30 s after its previous one at the next inner step set a 30 s step time, every round's grace window became two such
steps, and the other learners' rounds fell from 20 to 0.2 a second (real processes, 14 ms steps). Bounded, one update
moves the estimate at most d + (1 - d) x 32 = 7.2 times (d = `QuorumConfig.estimate_decay`, 0.8), and the others'
next updates take it back, each (1 - d) of the way. Honest samples stay inside the bound, so honest runs are unchanged:
0.13 to 23.6 times the estimate in the harness (the quick experiments, the default-scale `failures` one, failure
traces; the largest from learners that waited out the others' failures at the end of a run). A slowdown of every
learner beyond the bound is followed in a few updates."""

MIN_GRACE_S = 0.01
"""The adaptive window's floor in seconds, whatever the step time (and its cap never below it), unless
`QuorumConfig.grace_min_steps` or `grace_max_steps` is 0. Processes that share cores are descheduled for milliseconds
at a time, so updates that learners of a model with millisecond steps publish at the same inner step reach the syncer
milliseconds apart: a window of a quarter step (0.25 ms) closed each round on its first update (and one of two steps,
the cap, 2 ms, did little better). Those learners, already waiting for every result (the round trip, 31 ms, was 31 of
their steps), had their updates merged a version late or folded into their next one (264 folds in 311 rounds), and
the schedule moves that lateness sets off pulled the rounds forward (310 instead of 200): 4 learners of a 3-16-1 MLP
at AdamW 1e-2 on 2 cores, 800 steps, trained to 0.04-1.0 with spikes to 8, against 0.0001 for each learner's plain
loop and for the same run with a fixed 5 ms or 20 ms window, which also ran 10-30 % faster (docs/results.md,
"Defaults and rounds", item 19). From a 40 ms step on, a quarter step is longer: nothing changes there, nor in the
harness's 1 s steps."""


def bounded_step_time(sample: float, estimate: float | None) -> float:
    """A step-time sample in seconds, clipped to within a factor MAX_STEP_TIME_RATIO of the current `estimate` (none
    before the first sample, nor from an estimate of 0)."""
    if not estimate:
        return sample
    return min(max(sample, estimate / MAX_STEP_TIME_RATIO), estimate * MAX_STEP_TIME_RATIO)


def ema(value: float | None, sample: float, decay: float) -> float:
    """One step of an exponential moving average; the first sample starts it."""
    return sample if value is None else decay * value + (1 - decay) * sample


class Ema:
    """An exponential moving average of samples; `value` is None until the first."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def observe(self, sample: float) -> None:
        self.value = ema(self.value, sample, self.decay)


def grace_window(config: DilocoConfig, quorum: QuorumConfig, *, step_time_s: float | None,
                 quorum_time_s: float | None, sync_time_s: float | None) -> float:
    """Seconds to wait for stragglers once the quorum is present: adaptive, gamma times the slack the overlap leaves, at
    least `grace_min_steps` step times and MIN_GRACE_S (updates arriving together share a round even without slack),
    at most `grace_max_steps` of them and never more than tau - 1 (one step of the overlap is the estimates' margin;
    at tau <= 2 the cap is one step, the paper's), or MIN_GRACE_S where that is longer. The estimates are moving
    averages (None: no sample yet); without a step time the adaptive window is none."""
    if quorum.grace == "none":
        return 0.0
    if quorum.grace == "fixed":
        return quorum.grace_s
    if step_time_s is None:
        return 0.0
    slack = config.overlap_steps * step_time_s - (quorum_time_s or 0.0) - (sync_time_s or 0.0)
    cap_steps = min(quorum.grace_max_steps, max(1, config.overlap_steps - 1))
    if cap_steps <= 0:
        return 0.0
    least_s = MIN_GRACE_S if quorum.grace_min_steps else 0.0
    floor_s, cap_s = max(quorum.grace_min_steps * step_time_s, least_s), max(cap_steps * step_time_s, least_s)
    return min(max(quorum.grace_gamma * slack, floor_s), cap_s)


def round_margins(config: DilocoConfig, *, step_time_s: float | None, quorum_at: float | None, grace_s: float,
                  arrivals: Sequence[tuple[float, float | None]]) -> tuple[float, ...] | None:
    """For each on-time learner's (arrival time, own step time) in `arrivals`: how many of its own inner steps were
    left of the grace window when its update arrived, (quorum time + window - arrival) / its step time, 0 if it came
    at or after the window's end; None where the round had no window (no average step time `step_time_s` yet, grace
    "none") or a learner's step time is not known yet: the learners then move on lateness alone
    (`Learner._follow_close`). The window counts as at least `DilocoConfig.round_margin_steps` +
    `MARGIN_HEADROOM_STEPS` average steps long: in a shorter one every learner but the first would fall short of the
    margin and move ahead in every round, pulling the rounds forward (a harness run with tau = 2, a one-step window,
    did); counted this way the learner that made the quorum keeps its margin and the others move by how much later
    than half a step after it they arrived."""
    needed = None if step_time_s is None else (config.round_margin_steps + MARGIN_HEADROOM_STEPS) * step_time_s
    if quorum_at is None or grace_s <= 0 or needed is None:
        return None
    deadline = quorum_at + max(grace_s, needed)
    margins = []
    for arrived_at, own_step_time_s in arrivals:
        if not own_step_time_s:
            return None
        margins.append(max(0.0, (deadline - arrived_at) / own_step_time_s))
    return tuple(margins)
