"""How a ddiloco process ends: the exit statuses `ddiloco run`'s supervisor (and Ray's, and a user's own) reads to
decide whether to restart a process, and the errors a learner or evaluator raises to end with one.

One definition each: the supervisor, the command line and the session read them from here, so that no two copies of a
status can disagree. A status only one role ends with stays with that role: the syncer's core fault
(`runtime.syncer_service`), a learner whose launcher is gone (`launcher_watch`), a Ray actor's restart
(`runtime.ray_actor`), and the data-parallel baseline's workers' (`chaos.dp_common`).
"""

from __future__ import annotations

EXIT_DONE = 0
"""The process finished its work (a learner its inner-step budget)."""
EXIT_FAILED = 1
"""Something failed (`ddiloco run`: a learner was refused or failed, or no round was committed)."""
EXIT_USAGE = 2
"""A bad flag or config: a restart would fail the same way."""
EXIT_REFUSED = 3
"""A learner (or evaluator) the syncer refused: another model, algorithm config, token or schema; never restarted."""
EXIT_UNREACHABLE = 4
"""A learner whose syncer never answered within `LearnerConfig.connect_timeout_s` (the supervisor restarts it like a
crash: under `ddiloco run` its syncer is local, and on its way back)."""


class RefusedError(SystemExit):
    """The syncer refused this learner (different model, algorithm config, token or schema). A
    `SystemExit` with status 3: uncaught, it ends the script the way `ddiloco run` expects of a refused
    learner (which it never restarts). `reason` names the mismatch."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_REFUSED)
        self.reason = reason

    def __str__(self) -> str:
        return f"refused by the syncer: {self.reason}"


class ForeignCheckpointError(RefusedError):
    """The learner's checkpoint is another run's (`LearnerCheckpoint.foreign`): exit status 3, as a refusal, since a
    restart would find the same checkpoint."""

    def __str__(self) -> str:
        return self.reason


class UnreachableError(SystemExit):
    """The syncer never answered within `LearnerConfig.connect_timeout_s` (a wrong address, a syncer that is not
    running, a firewall). A `SystemExit` with status 4; `reason` names the address and the last error."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_UNREACHABLE)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason
