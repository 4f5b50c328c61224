"""The counters one learner keeps for its driver to report (`Learner.stats`: metrics, status.json)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LearnerStats:
    """Counters a driver reports as metrics."""

    updates_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    updates_withheld_non_finite: int = 0
    updates_published_early: int = 0
    """Updates sent because the round they belonged to closed first (`Learner._publish_before`)."""
    phase_moves_late: int = 0
    """Schedule moves forward of a learner whose update reached its round after the close (`_follow_close`)."""
    phase_moves_margin: int = 0
    """Schedule moves forward of a learner whose update was on time with less than `round_margin_steps` of the
    grace window left."""
    phase_moves_early: int = 0
    """Schedule moves back of a paced learner whose update went out before the clock-setting learners'."""
    fragments_applied: int = 0
    fragments_ignored_stale: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    waits_abandoned: int = 0
    joins: int = 0
    downlink_resyncs: int = 0
    """Fragment changes this learner could not rebuild (another base version, a checksum that disagrees),
    each answered by joining again."""
    non_finite_recoveries: int = 0
    """Times the learner found its own model not finite and went back to the global value (`Learner.recover`)."""
    publishes_waited: int = 0
    """Fragments that fell due while the result for their last update was still owed, so their publish waited for it
    (`Learner.after_inner_step`; with tau >= H, or after the schedule moved forward)."""
