"""A disk that fills up (or fails) while a run goes on: nothing committed is lost, nothing is torn, and the
run goes on once writes work again (issue 13 item 3).

The faults are injected: a journal or a store whose writes raise ENOSPC, `os.write` that writes half a line
and fails. tests/integration/test_syncer_service.py fills a real tmpfs under a real run.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from ddiloco.checkpoint import WriteTrouble
from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Commit, Join, Rejected, RejectReason, RoundRecord, Send, Update
from ddiloco.metrics import JsonlSink, MemorySink, NullSink
from ddiloco.round_journal import STORAGE_RETRY_S
from ddiloco.round_log import RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer, replay_rounds
from tests.helpers import TinyNet, filled_update, params_of

CONFIG = DilocoConfig(num_fragments=2, fragment_strategy="strided", codec="fp32", sync_every=4)
QUORUM = QuorumConfig(min_quorum=1, grace="none")
FULL = OSError(errno.ENOSPC, "No space left on device")


class FlakyJournal:
    """A journal that raises ENOSPC while `full`."""

    def __init__(self) -> None:
        self.full = False
        self.records: list[RoundRecord] = []
        self.attempts = 0

    def commit(self, record: RoundRecord) -> None:
        self.attempts += 1
        if self.full:
            raise FULL
        self.records.append(record)


def _rejections(actions) -> list[Rejected]:
    return [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, Rejected)]


def test_a_round_that_cannot_be_made_durable_changes_nothing_and_the_next_one_continues_the_log():
    journal = FlakyJournal()
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)), journal=journal)
    syncer.receive(Join(0, syncer.spec, CONFIG.fingerprint()), 0.0)
    assert [a for a in syncer.receive(filled_update(syncer, 0, 0, inner_step=4), 1.0) if isinstance(a, Commit)]
    before, outer_before = syncer.global_params(), syncer.outer.state_dict()

    journal.full = True
    actions = syncer.receive(filled_update(syncer, 0, 1, inner_step=8), 2.0)
    assert not [a for a in actions if isinstance(a, Commit)]
    (rejected,) = _rejections(actions)
    assert rejected.reason == RejectReason.UNAVAILABLE and "No space left" in rejected.detail
    # Nothing moved: the version, the round count, the global values, the momentum, the learner's merged base.
    assert (syncer.versions, syncer.rounds_committed, syncer.held_updates()) == ([1, 0], 1, [])
    assert all(torch.equal(before[n], t) for n, t in syncer.global_params().items())
    assert syncer.outer.state_dict()[1] == outer_before[1]
    assert syncer.learners[0].merged_base == {0: 0}
    assert "round 1" in syncer.storage_error

    # While the disk is full, updates are refused without another try at the journal.
    attempts = journal.attempts
    (refused,) = _rejections(syncer.receive(filled_update(syncer, 0, 1, inner_step=12), 2.0 + STORAGE_RETRY_S / 2))
    assert refused.reason == RejectReason.UNAVAILABLE and journal.attempts == attempts
    assert syncer.rejection_counts["unavailable"] == 2

    # Space is back: the next round after the retry time is round 1, from the same base, with all the steps.
    journal.full = False
    actions = syncer.receive(filled_update(syncer, 0, 1, inner_step=16), 2.0 + STORAGE_RETRY_S)
    (commit,) = [a for a in actions if isinstance(a, Commit)]
    assert (commit.record.round_index, commit.record.fragment, commit.record.version) == (1, 1, 1)
    assert commit.record.participants[0].steps == 16
    assert syncer.storage_error is None and syncer.versions == [1, 1]
    replayed = replay_rounds(CONFIG, params_of(TinyNet(seed=100)), journal.records)
    assert all(torch.equal(replayed[n], t) for n, t in syncer.global_params().items())


class FullDiskStore(SyncerStore):
    """The real store on a disk that is full while `full`: writes raise ENOSPC before touching a file."""

    full = False

    def commit(self, record: RoundRecord) -> None:
        if self.full:
            raise FULL
        super().commit(record)

    def save(self, syncer: Syncer, meta: dict) -> None:
        if self.full:
            raise FULL
        super().save(syncer, meta)


def test_the_service_refuses_updates_with_a_reason_while_the_disk_is_full_and_the_run_directory_stays_whole(
        tmp_path):
    # Before: the core advanced its versions, then the store's commit raised ENOSPC into the gRPC handler
    # (UNKNOWN, no recorded rejection); the log then read rounds 0-4 then 9-13 and a restart refused it.
    run_config = RunConfig(diloco=CONFIG, quorum=QUORUM, num_learners=1)
    store = FullDiskStore(tmp_path, keep_round_files=True)  # every round's file, for the replay from the genesis below
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)))
    clock = VirtualClock()
    service = SyncerService(run_config, syncer, store, sink=NullSink(), clock=clock,
                            config=SyncerServiceConfig(full_state_every_rounds=1))  # full states fail too
    assert not isinstance(service.join(Join(0, syncer.spec, CONFIG.fingerprint()), CONFIG.to_dict(), "test"), str)
    step = 0

    def push(fragment: int) -> tuple[bool, str, str]:
        nonlocal step
        step += 4
        return service.update(filled_update(syncer, 0, fragment, inner_step=step))

    assert push(0)[0] and push(1)[0]
    store.full = True
    verdicts = [push(p) for p in (0, 1)]
    assert [(accepted, reason) for accepted, reason, _ in verdicts] == [(False, "unavailable")] * 2
    assert "No space left on device" in verdicts[0][2] and "retrying" in verdicts[1][2]
    assert service.status()["storage_error"] and service.rejections["unavailable"] == 2
    assert syncer.rounds_committed == 2 and syncer.versions == [1, 1]
    store.full = False
    clock.advance_to(STORAGE_RETRY_S)
    assert push(0)[0] and push(1)[0]
    assert service.status()["storage_error"] is None
    service.close()

    records = list(RoundLog(tmp_path).records())  # raises on a gap
    assert [(r.round_index, r.fragment, r.version) for r in records] == [(0, 0, 1), (1, 1, 1), (2, 0, 2), (3, 1, 2)]
    restored = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)))
    SyncerStore(tmp_path).restore(restored)  # a restart reads the same log
    assert restored.rounds_committed == 4
    assert all(torch.equal(restored.global_params()[n], t) for n, t in syncer.global_params().items())


def _half_write_then_full(monkeypatch):
    real_write = os.write

    def write(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise FULL

    monkeypatch.setattr(os, "write", write)


def test_an_append_that_fails_halfway_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)), journal=SyncerStore(tmp_path))
    log = RoundLog(tmp_path)
    syncer.receive(Join(0, syncer.spec, CONFIG.fingerprint()), 0.0)
    syncer.receive(filled_update(syncer, 0, 0, inner_step=4), 1.0)
    good = log.path.read_bytes()
    with monkeypatch.context() as patch:
        _half_write_then_full(patch)
        (rejected,) = _rejections(syncer.receive(filled_update(syncer, 0, 1, inner_step=8), 2.0))
    assert rejected.reason == RejectReason.UNAVAILABLE
    assert log.path.read_bytes() == good  # no torn half line for the next append to follow
    assert not log.tensors_path(1).exists() and not list(log.tensor_dir.glob(".*.tmp"))
    syncer.receive(filled_update(syncer, 0, 1, inner_step=12), 2.0 + STORAGE_RETRY_S)
    assert [r.round_index for r in log.records()] == [0, 1]


def test_metrics_lines_are_dropped_whole_and_counted_when_the_disk_is_full(tmp_path, monkeypatch):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.event("before")
    with monkeypatch.context() as patch:
        _half_write_then_full(patch)
        for step in range(3):
            sink.log({"loss": 1.0}, step=step)  # never raises: a full disk must not stop the run
    sink.event("after")
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("event") for line in lines] == ["before", "dropped_lines", "after"]
    assert lines[1]["lines"] == 3 and sink.dropped == 3


def test_lines_appended_after_a_line_cut_short_start_on_a_line_of_their_own(tmp_path):
    # A host crash mid-write leaves the last line cut; the next process's first line was glued onto it, and that
    # line, unreadable, was lost with the cut one.
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "before"}\n{"event": "cut sh')
    sink = JsonlSink(path)
    sink.event("start")
    sink.event("next")
    sink.close()
    lines = path.read_text().splitlines()
    assert lines[:2] == ['{"event": "before"}', '{"event": "cut sh'] and len(lines) == 4
    assert [json.loads(line)["event"] for line in lines[2:]] == ["start", "next"]
    whole = path.read_text()
    JsonlSink(path).close()  # a file that ends with a whole line gets nothing added
    assert path.read_text() == whole


def test_write_trouble_reports_once_when_writes_fail_and_once_when_they_work_again(caplog):
    trouble = WriteTrouble("status file")

    def fail():
        raise FULL

    with caplog.at_level("WARNING"):
        assert not trouble.attempt(fail) and not trouble.attempt(fail)
        assert trouble.attempt(lambda: None)
    assert trouble.failures == 2 and trouble.failing is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "cannot write status file" in messages[0] and "written again" in messages[1]


def test_other_errors_than_oserror_are_not_swallowed():
    with pytest.raises(ZeroDivisionError):
        WriteTrouble("x").attempt(lambda: 1 / 0)


class WatchedStore(SyncerStore):
    """The real store, noting in the sink's event list where each round became durable."""

    def __init__(self, run_dir, sink: MemorySink) -> None:
        super().__init__(run_dir)
        self.sink = sink

    def commit(self, record: RoundRecord) -> None:
        super().commit(record)
        self.sink.events.append({"kind": "durable", "round": record.round_index})


def test_the_update_that_closes_a_round_is_logged_right_after_the_round_is_durable(tmp_path):
    # Before: the "update" line came after the round's results went out (its commit line, the sends), so a kill -9
    # in between left a merged update the syncer's log never showed accepted: a soak run under load failed
    # every_update_merged_or_rejected_with_reason that way.
    run_config = RunConfig(diloco=CONFIG, quorum=QUORUM, num_learners=1)
    sink = MemorySink()
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)))
    service = SyncerService(run_config, syncer, WatchedStore(tmp_path, sink), sink=sink, clock=VirtualClock())
    assert not isinstance(service.join(Join(0, syncer.spec, CONFIG.fingerprint()), CONFIG.to_dict(), "test"), str)
    assert service.update(filled_update(syncer, 0, 0, inner_step=4))[0]
    stale = filled_update(syncer, 0, 0, inner_step=8)
    stale = Update(0, 0, stale.base_version - 1, 8, 8, 80, "fp32", stale.payload)  # on a version since replaced
    assert not service.update(stale)[0]
    service.close()
    kinds = [(e["kind"], e.get("accepted")) for e in sink.events if e["kind"] in ("durable", "update", "commit")]
    assert kinds == [("durable", None), ("update", True), ("commit", None), ("update", False)]


class ReentrantSink(MemorySink):
    """Runs `then` once, inside the first round's commit event: another update arriving the moment the first one's
    round is done, before that first update's handler has finished (what a second gRPC handler thread does)."""

    def __init__(self) -> None:
        super().__init__()
        self.then = None

    def event(self, kind: str, **fields) -> None:
        super().event(kind, **fields)
        if kind == "commit" and self.then is not None:
            then, self.then = self.then, None
            then()


def test_an_update_arriving_while_another_finishes_does_not_make_it_logged_twice(tmp_path):
    # Before: whether the closing update had been logged was read from the service after its lock was released,
    # so an update handled in between reset it and the first update got a second "accepted" line (the chaos
    # invariant then counted it accepted twice but merged once).
    run_config = RunConfig(diloco=CONFIG, quorum=QUORUM, num_learners=1)
    sink = ReentrantSink()
    syncer = Syncer(CONFIG, QUORUM, initial_params=params_of(TinyNet(seed=100)))
    service = SyncerService(run_config, syncer, SyncerStore(tmp_path), sink=sink, clock=VirtualClock())
    assert not isinstance(service.join(Join(0, syncer.spec, CONFIG.fingerprint()), CONFIG.to_dict(), "test"), str)
    second = filled_update(syncer, 0, 1, inner_step=8)
    second = Update(0, 1, 7, 8, 8, 80, "fp32", second.payload)  # on a version fragment 1 never had: rejected
    verdicts = []
    sink.then = lambda: verdicts.append(service.update(second))
    assert service.update(filled_update(syncer, 0, 0, inner_step=4))[0]
    service.close()
    assert [accepted for accepted, _, _ in verdicts] == [False]
    lines = [(e["fragment"], e["inner_step"], e["accepted"]) for e in sink.events if e["kind"] == "update"]
    assert sorted(lines) == [(0, 4, True), (1, 8, False)]
