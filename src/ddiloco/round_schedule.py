"""When one learner publishes: its place on the run's round clock (docs/protocol.md, "Rounds").

Round r syncs fragment r mod P and falls due at inner step `due_step(r, H, P)`. A learner publishes round r once
its step count plus its `phase` reaches that step: the phase is how far its schedule runs ahead of its step count.
It moves forward when the learner's updates miss the rounds (late moves: the rounds run to other learners' clocks)
or arrive near the grace window's end (margin moves, and the drift learned from them), back when a learner that
paces itself opened a round, and with `pace_rounds` it grows by the difference between a slow learner's step count
and the rounds' pace (Dynamic Local Updates). This module owns that clock and those
moves; the learner core (`ddiloco.learner`) decides from the protocol's messages when each move is due.

Counts only: no wall time, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddiloco.fragments import due_step
from ddiloco.messages import Welcome

ROUND_PACE_SMOOTHING = 0.1
"""Weight of each new round in `RoundSchedule.round_pace`: about ten rounds (2.5 periods at P = 4) of memory, which
averages out step-time jitter and the grace window's variation."""
ROUND_PACE_DEADBAND = 0.05
"""A learner within 5 % of the rounds' pace keeps its schedule: the learners that set the clock must not chase
their own noise (publishing earlier would close rounds earlier, and the next estimate would be lower still)."""
MIN_ROUND_PACE = 0.5
"""The fastest a schedule runs: twice the learner's step count."""
PHASE_LOCK_STEP = 1.0
"""Inner steps a learner's schedule moves forward when a round's result shows its update was late, for each late
result in a row (the n-th moves n steps, at most half a round's spacing), and a paced learner's back, when it was early
(`RoundSchedule.late`, `RoundSchedule.early`): within the adaptive grace window (at most two steps at the defaults),
so a first move lands the update inside the window rather than past it, and a learner whose deficit per round is
larger than one step catches up. Measured against 0.5 and 2 (docs/results.md, "Defaults and rounds")."""
EARLY_LEAD = 2
"""A round's result that reaches a learner this many of its inner steps after its update for that round or later:
the update went out before the clock-setting learners' (theirs reach them about tau steps after theirs), so it
probably opened the round itself."""


class RoundSchedule:
    """One learner's round clock: the next round it publishes, its phase, its pace against the rounds."""

    def __init__(self, sync_every: int, num_fragments: int, *, pace_rounds: bool) -> None:
        self.sync_every = sync_every
        self.num_fragments = num_fragments
        self.pace_rounds = pace_rounds
        self.next_round = 0
        self.phase = 0.0
        """Inner steps this schedule runs ahead of the learner's step count: raised each time a round closes before
        the learner published its part (`closed_before_publish`) or a round's result shows its update came after the
        close (`late`), so its next rounds fall due in time for the others'; a paced learner that leads the rounds
        moves it back (`early`), which can leave it below 0 (behind its count)."""
        self.follows_rounds = True
        """Whether a late learner moves its schedule forward; off where rounds wait for every learner anyway (K = M:
        `LearnerRules` turns it off), since each move adds publications."""
        self.round_pace = 1.0
        """Moving average of (own inner steps between two rounds' results) / (H / P): below 1, this learner is
        slower than the learners whose rounds set the clock (`observe_result`)."""
        self.drift = 0.0
        """Inner steps this schedule moves forward with every result of a round it published for, learned from its
        margins (`keep_margin`): a learner slower than the clock-setting learners by d steps per round comes to
        move about d every round, so its updates keep their margin instead of arriving d short of it."""
        self.late_in_a_row = 0
        """Results in a row that left this learner's update out (`late`): the next such moves it one step more, up to
        `late_move_limit`."""
        self._published_early: set[int] = set()
        """Rounds whose update went out before they fell due (`closed_before_publish`): skipped when they do."""
        self._last_result: tuple[int, int] | None = None
        """(round index, own inner step) of the newest round result received."""

    @property
    def late_move_limit(self) -> int:
        """The largest late move, in inner steps: half a round's spacing (2 at H = 16, P = 4). A straggler's deficit
        per round is below it (1.1-1.4 steps for one 30-36 % slower); where rounds close on the first update (K = 1
        without grace) every other learner is late in every round, and larger moves only pull the rounds forward
        faster (harness, the `heterogeneous` set-up without grace: 2.6871 with one-step moves, 2.8514 with this
        limit, 2.9753 with a whole spacing; docs/results.md)."""
        return max(1, self.sync_every // self.num_fragments // 2)

    @property
    def drift_limit(self) -> float:
        """The largest drift: what this learner's pace lacks of the rounds' per round (`round_pace`), and at most
        `late_move_limit`. A learner that keeps the rounds' pace (the ones that set their clock) gets none, so the
        rounds keep running to the fastest learners' step counts."""
        spacing = self.sync_every / self.num_fragments
        return min(max(0.0, 1.0 - self.round_pace) * spacing, float(self.late_move_limit))

    @property
    def reads_slow(self) -> bool:
        """Whether this learner paces itself: `pace_rounds`, following the rounds, and measured clearly slower."""
        return self.pace_rounds and self.follows_rounds and self.round_pace < 1.0 - ROUND_PACE_DEADBAND

    def due_rounds(self, inner_step: int) -> list[int]:
        """After inner step `inner_step`: the rounds that have fallen due and are still to publish, oldest first
        (those published early are skipped). A paced learner's schedule first advances by its pace."""
        if self.reads_slow:
            # Clamped: a learner that blocks (a slow syncer) must not be driven to publish every step.
            self.phase += 1.0 / max(self.round_pace, MIN_ROUND_PACE) - 1.0
        rounds = []
        while due_step(self.next_round, self.sync_every, self.num_fragments) <= inner_step + self.phase:
            if self.next_round in self._published_early:
                self._published_early.discard(self.next_round)
            else:
                rounds.append(self.next_round)
            self.next_round += 1
        return rounds

    def closed_before_publish(self, fragment: int, version: int, inner_step: int) -> None:
        """The round that made `version` of `fragment` closed before this learner published its part, which went out
        just now, at inner step `inner_step` (`Learner._publish_before`). If that round is still ahead on this
        schedule it is skipped when it falls due, and the schedule moves forward by one step more than the learner
        was short of it (at most a round's spacing, so no rounds fall due at once): repeated while it is late, this
        brings its updates into the others' rounds instead of one version after them. Not after a fragment's first
        round: the syncer has no step-time estimate yet, so that round closes without a grace window on the first
        update, before learners in phase report; moving them would split the learners into two groups that
        alternate."""
        num = self.num_fragments
        scheduled = self.next_round + (fragment - self.next_round) % num
        if scheduled > num * (version - 1) + fragment:
            return
        self._published_early.add(scheduled)
        if self.follows_rounds and version >= 2:
            short = due_step(scheduled, self.sync_every, num) - (inner_step + self.phase)
            self.phase += max(1, min(short + 1, self.sync_every // num))

    def late(self) -> None:
        """A round's result left this learner's update out: move one step more than after the last late result in a
        row, at most `late_move_limit`."""
        self.late_in_a_row += 1
        self.phase += PHASE_LOCK_STEP * min(self.late_in_a_row, self.late_move_limit)

    def on_time(self) -> None:
        """A round's result named this learner's update: the next late result moves one step again."""
        self.late_in_a_row = 0

    def keep_margin(self, margin: float, *, target: float, gain: float, move_short: bool = True) -> None:
        """A result of a round this learner published for, whose update arrived with `margin` inner steps of the grace
        window left (0 for a late one): move by the drift, then by what the margin falls short of `target` (unless
        `move_short` is false: a late result moves by `late` instead), and let the drift follow the shortfall by
        `gain` (down too, for a margin beyond `target`), within 0 and `drift_limit`."""
        short = target - margin
        self.phase += self.drift
        self.drift = min(max(self.drift + gain * short, 0.0), self.drift_limit)
        if move_short and short > 0:
            self.phase += short

    def follow_result(self, *, named: bool | None, margins_sent: bool, margin: float | None, target: float,
                      gain: float, lead_steps: int) -> set[str]:
        """The result of the round this learner's last update was for reached it (`Learner._follow_close`, which says
        when this applies): move as that result says, and return the moves taken ("late", "margin", "early").
        `named`: whether the result names this learner among those merged on time (None: it names nobody, an older
        syncer); `margins_sent`: whether it carries margins at all; `margin`: this learner's, when named; `target`,
        `gain`: `round_margin_steps` and `round_margin_gain`; `lead_steps`: this learner's inner steps since that
        update went out.

        Not named: the update reached the syncer after the close, so the rounds run to other learners' clocks (a
        learner back from a failure leads it in phase, it started later, or its steps are slower), and the schedule
        moves forward (`late`: within the adaptive grace window, so the next update lands inside it; one step more for
        each late result in a row, so a learner that falls behind by more than a step per round catches up instead of
        settling at the close); the drift learns from a margin of 0. Named: the late streak ends, and a margin short
        of `target` moves it by the shortfall (`keep_margin`). A learner that paces itself and got the result
        `EARLY_LEAD` or more of its steps after its update probably opened the round itself: it moves back (`early`),
        since a slow learner must never set the rounds' clock (publishing ever earlier would close rounds earlier, and
        every learner's pace would read lower: the ratchet)."""
        moves = set()
        if named is False:
            if target > 0 and margins_sent:
                self.keep_margin(0.0, target=target, gain=gain, move_short=False)
            self.late()
            return {"late"}
        if named:
            self.on_time()
            if margin is not None and target > 0:
                if margin < target:
                    moves.add("margin")
                self.keep_margin(margin, target=target, gain=gain)
        if self.reads_slow and lead_steps >= EARLY_LEAD:
            self.early()
            moves.add("early")
        return moves

    def early(self) -> None:
        """A paced learner's update probably opened its round: move back a step (below 0 too)."""
        self.phase -= PHASE_LOCK_STEP

    def observe_result(self, round_index: int, inner_step: int, *, blocked: bool) -> None:
        """A round's result reached the learner at its inner step `inner_step`: measure its pace against the rounds'
        clock. The rounds close when the others publish, so a learner that needs fewer of its own inner steps than
        H / P between two rounds' results is slower than them; with `pace_rounds` its schedule then runs faster than
        its step count (`due_rounds`), so it publishes after fewer inner steps, in time for the others' rounds,
        instead of one version late in every round (Dynamic Local Updates). `blocked`: the learner waited for the
        syncer since the last result, so the interval measured the syncer, not its own pace."""
        last, self._last_result = self._last_result, (round_index, inner_step)
        if last is None or round_index <= last[0] or not self.follows_rounds or blocked:
            return
        spacing = self.sync_every / self.num_fragments
        sample = (inner_step - last[1]) / ((round_index - last[0]) * spacing)
        # Capped above only far from 1: a cap at 1 would bias the average of a learner in pace downwards.
        self.round_pace += ROUND_PACE_SMOOTHING * (min(sample, 2.0) - self.round_pace)

    def take_position(self, next_round: int) -> int:
        """Publish `next_round` next, from its due step on, forgetting the phase and the late count; returns the inner
        step the learner is put at (one before `next_round` falls due)."""
        self.next_round = next_round
        self._published_early.clear()
        self.phase = 0.0
        self.drift = 0.0
        self.late_in_a_row = 0
        self._last_result = None
        return due_step(next_round, self.sync_every, self.num_fragments) - 1

    def state_dict(self) -> dict:
        return {"next_round": self.next_round, "phase": self.phase, "round_pace": self.round_pace, "drift": self.drift}

    def load_state_dict(self, state: Mapping) -> None:
        self.next_round = int(state["next_round"])
        self.phase = float(state.get("phase", 0))
        self.round_pace = float(state.get("round_pace", 1.0))
        self.drift = float(state.get("drift", 0.0))
        self._published_early.clear()


def next_uncommitted_round(welcome: Welcome) -> int:
    """The oldest round not yet committed, if every round commits once (K = M; see
    `ddiloco.learner.Learner.take_schedule_position`)."""
    num = len(welcome.fragments)
    return min(num * state.version + state.fragment for state in welcome.fragments)
