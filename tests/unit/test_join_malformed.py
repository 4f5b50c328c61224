"""A join the syncer cannot read (INVALID_ARGUMENT: a malformed join, which the same learner sends again each time) is
a refusal after a few answers in a row, with the syncer's words: the learner retried it for ever, several times a
second, while the run sat at "joining" (tied weights whose names held "=", which the join's alias encoding split)."""

from __future__ import annotations

import time

import grpc

from ddiloco.messages import Join, ModelSpec, Refused
from ddiloco.transport.grpc_codec import WireError
from ddiloco.transport.learner_io import MALFORMED_JOINS_TO_REFUSE, MISFIT_WELCOMES_TO_REFUSE, LearnerIO
from tests.helpers import StubSyncerClient

WAIT_S = 30.0
MALFORMED = "malformed: alias 'a=b=c': expected ALIAS=PARAMETER for a parameter of the model"


class Answer(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


class Syncer(StubSyncerClient):
    """A client whose every subscription is answered with `answer`."""

    def __init__(self, answer: Exception) -> None:
        self.answer, self.subscriptions = answer, 0

    def subscribe(self, join):
        self.subscriptions += 1
        raise self.answer


def messages_within(io: LearnerIO, seconds: float) -> list:
    deadline, seen = time.monotonic() + seconds, []
    while time.monotonic() < deadline and not any(isinstance(m, Refused) for m in seen):
        io.inbox.wait(deadline - time.monotonic())
        seen += io.inbox.take_ready()
    return seen


def refusal_after(answer: Exception) -> tuple[Refused, int]:
    """The refusal of a learner whose every subscription is answered with `answer`, and how many times it joined."""
    syncer = Syncer(answer)
    io = LearnerIO(syncer, Join(0, ModelSpec(()), "x"), heartbeat_every_s=60.0)
    io.start()
    try:
        (refused,) = [m for m in messages_within(io, WAIT_S) if isinstance(m, Refused)]
    finally:
        io.close(leave=False)
    return refused, syncer.subscriptions


def test_a_join_the_syncer_cannot_read_is_refused_after_a_few_answers_with_its_words():
    refused, joins = refusal_after(Answer(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED))
    assert joins == MALFORMED_JOINS_TO_REFUSE
    assert refused.reason == f"the syncer cannot read this learner's join (INVALID_ARGUMENT: {MALFORMED})"


def assert_asked_again_past(answer: Exception, bound: int) -> None:
    """A learner whose every subscription is answered with `answer` joins more than `bound` times, unrefused."""
    syncer = Syncer(answer)
    io = LearnerIO(syncer, Join(0, ModelSpec(()), "x"), heartbeat_every_s=60.0)
    io.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while syncer.subscriptions <= bound:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not any(isinstance(m, Refused) for m in io.inbox.take_ready())
    finally:
        io.close(leave=False)


def test_a_syncer_out_of_room_for_now_is_asked_again():
    # RESOURCE_EXHAUSTED (too many streams at once) passes: the learner keeps trying, as before.
    assert_asked_again_past(Answer(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many subscriptions"),
                            MALFORMED_JOINS_TO_REFUSE)


def test_a_welcome_that_does_not_fit_the_learners_model_is_a_refusal_after_a_few_in_a_row():
    # The syncer's fragments held other tensors than the learner's (a process of another version, whose plan for a
    # Hugging Face model's names differed): the learner re-joined for ever (99 times in 3 minutes), the run never ended.
    refused, joins = refusal_after(WireError("wrong_tensors", "fragment 0 holds tensors ['a', 'b'], got ['a', 'c']"))
    assert joins == MISFIT_WELCOMES_TO_REFUSE
    assert "do not fit this learner's model, 3 times in a row (wrong_tensors: fragment 0 holds" in refused.reason
    assert "--fragment-strategy" in refused.reason


def test_a_message_damaged_in_flight_is_joined_again_without_a_bound():
    assert_asked_again_past(WireError("corrupt", "fragment 0: CRC32 of its 64 tensor bytes is 1, the header says 2"),
                            MISFIT_WELCOMES_TO_REFUSE)
