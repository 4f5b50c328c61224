"""What a learner has sent and what it is owed: per fragment, its last update and that update's fate as far as the
learner knows.

`SentUpdates` answers the learner core's (`ddiloco.learner`) questions about its own updates: which fragment's round
result is owed (the waiting rule blocks on those past `overlap_steps`), which update never reached the syncer or was
refused for who sent it (its work counts as not sent: the next publish, a newer version or a Welcome sends it), and
whether the work since a fragment's base has gone out at all. It holds no tensors and sends nothing: the core
publishes, and tells it what happened (`published`, `applied`, `undelivered`, `refused`, `withdrawn`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SentUpdate:
    """A fragment's last update whose round result the learner may still await."""

    base_version: int
    published_at_step: int
    undelivered: bool = False
    """It never reached the syncer, or the syncer refused it for who sent it (`unknown_learner`): no result is owed
    (it blocks nothing), and its work counts as not sent."""


class SentUpdates:
    """Per fragment, the last update this learner published and, while its round result may still come, its fate."""

    def __init__(self, num_fragments: int) -> None:
        self._awaiting: dict[int, SentUpdate] = {}
        """Fragments whose last update's round result may still come (or that never reached the syncer)."""
        self._sent_from: list[int | None] = [None] * num_fragments
        """Per fragment, the base version of the last update whose work went out (None: none yet, or it did not)."""

    def __contains__(self, fragment: int) -> bool:
        return fragment in self._awaiting

    def get(self, fragment: int) -> SentUpdate | None:
        return self._awaiting.get(fragment)

    def items(self) -> list[tuple[int, SentUpdate]]:
        return sorted(self._awaiting.items())

    # ---- what the learner did and heard -----------------------------------------------------------------------------

    def published(self, fragment: int, base_version: int, inner_step: int) -> None:
        self._awaiting[fragment] = SentUpdate(base_version, inner_step)
        self._sent_from[fragment] = base_version

    def applied(self, fragment: int, version: int) -> None:
        """A version of the fragment arrived: a result newer than the update's base ends the wait for it."""
        sent = self._awaiting.get(fragment)
        if sent is not None and version > sent.base_version:
            del self._awaiting[fragment]

    def undelivered(self, fragment: int, base_version: int, inner_step: int) -> None:
        """The update published at `inner_step` from `base_version` never reached the syncer (or the syncer refused
        it for who sent it): it blocks nothing, and its work counts as not sent. An older update's notice, or one whose
        result arrived meanwhile, changes nothing."""
        sent = self._awaiting.get(fragment)
        if sent is None or sent.base_version != base_version or sent.published_at_step != inner_step:
            return
        self._awaiting[fragment] = replace(sent, undelivered=True)
        if self._sent_from[fragment] == base_version:
            self._sent_from[fragment] = None

    def refused(self, fragment: int, base_version: int, *, for_sender_at: int | None = None) -> None:
        """The syncer refused the fragment's update from `base_version`: no result is owed for it. `for_sender_at`: it
        refused the update published at that inner step for who sent it (`unknown_learner`: it restarted, or timed the
        learner out), not for what it carries: if that is the last update, its work counts as not sent, as an
        undelivered one's. The refusal of an older update of the same base does not count the later one's work as not
        sent (that one was accepted, or gets its own refusal); no result is awaited for it any more, as before."""
        sent = self._awaiting.get(fragment)
        if sent is None or sent.base_version != base_version:
            return
        if for_sender_at is not None and sent.published_at_step == for_sender_at:
            self.undelivered(fragment, base_version, for_sender_at)
            return
        del self._awaiting[fragment]

    def withdrawn(self, fragment: int, base_version: int) -> None:
        """The update was withheld after all (its pseudo-gradient not finite): as if never published."""
        self.refused(fragment, base_version)
        if self._sent_from[fragment] == base_version:
            self._sent_from[fragment] = None

    def abandon(self, fragments: list[int]) -> None:
        """Stop waiting for these fragments' results (the driver's wait bound)."""
        for fragment in fragments:
            del self._awaiting[fragment]

    def keep_after_welcome(self, inner_step: int, versions: list[int]) -> None:
        """After a Welcome: only updates published at this very step (just now, again) from the versions it left are
        awaited."""
        self._awaiting = {p: s for p, s in self._awaiting.items()
                          if s.published_at_step == inner_step and s.base_version == versions[p]}

    # ---- what the learner asks ---------------------------------------------------------------------------------------

    def blocking(self, inner_step: int, overlap_steps: int) -> list[int]:
        """Fragments published `overlap_steps` or more inner steps ago whose result has not come (delivered ones)."""
        return sorted(p for p, s in self._awaiting.items()
                      if inner_step >= s.published_at_step + overlap_steps and not s.undelivered)

    def owed(self, fragment: int, version: int) -> bool:
        """Whether the fragment's last update, published from `version` (the one held), awaits its round."""
        sent = self._awaiting.get(fragment)
        return sent is not None and sent.base_version == version and not sent.undelivered

    def sent_since(self, fragment: int, version: int) -> bool:
        """Whether the work trained on `version` of the fragment went out in an update (delivered, as far as known)."""
        return self._sent_from[fragment] == version

    def undelivered_fragments(self) -> list[int]:
        return sorted(p for p, s in self._awaiting.items() if s.undelivered)
