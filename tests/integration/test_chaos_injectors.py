"""In-process fault injection on real processes: a `ddiloco learner --chaos-control FILE` obeys each
kind of fault the test switches on in that file, and its work ledger accounts for every update.

One real `ddiloco syncer` and one real learner serve the whole module (starting processes that import
torch is the slow part on this machine); each test switches one kind of fault on for a window with
`write_control`, checks what it did from the learner's work.jsonl and metrics.jsonl and the syncer's
status, and leaves the file empty. One learner keeps the downlink quiet while its updates are lost
(no round closes without them), so every uplink fault shows in the ledger undisturbed. The module's
last process test stops both processes and checks the invariants over the whole run: every publish
has exactly one fate, the syncer's verdicts match the ledger's, and the global state replays from
rounds.jsonl.

Two faults need messages placed exactly: a version sent down while the learner is cut off (which
takes a second learner to close a round), and an update and a version corrupted one after the other
(in a real run, whichever comes first after the switch is corrupted). Those tests run the syncer
service in this process behind real gRPC on loopback, with two learners' I/O threads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddiloco.checkpoint import load_latest_state, read_json
from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig
from ddiloco.data import DataConfig
from ddiloco.fault_control import ActiveFault, ChaosControl, control_path, write_control
from ddiloco.learner import Learner
from ddiloco.messages import FragmentDelta, Welcome
from ddiloco.metrics import MemorySink
from ddiloco.model import ModelConfig, build_model
from ddiloco.round_log import RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService, SyncerServiceConfig
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer, replay_rounds
from ddiloco.train_tinygpt import initial_params
from ddiloco.transport.grpc_client import SyncerClient
from ddiloco.transport.grpc_codec import WireModel
from ddiloco.transport.grpc_server import start_server
from ddiloco.transport.learner_io import LearnerIO
from ddiloco.transport.link import NO_FAULTS, unlimited_link
from tests.helpers import PROCESS_WAIT_S, TINY_MODEL_FLAGS, Processes, wait_until

pytestmark = pytest.mark.integration

RUN_FLAGS = (*TINY_MODEL_FLAGS, "--learners", "1", "--inner-steps", "100000000", "--num-fragments", "2",
             "--sync-every", "8", "--max-wait-s", "0.5", "--heartbeat-timeout-s", "3", "--heartbeat-every-s", "0.5")
"""A learner that never finishes on its own, trains on 0.5 s after a lost round, and is timed out
after 3 s of silence."""
REFRESH_S = 0.1
"""How long a learner may take to notice a new control file (ChaosControl's refresh period), plus
scheduling slack on a loaded machine: fates this close to a window's start are not judged."""
WINDOW_S = 2.5


@dataclass
class Run:
    run_dir: Path
    syncer: object
    learner: object
    control: Path

    @property
    def learner_dir(self) -> Path:
        return self.run_dir / "learners" / "0"

    def ledger(self) -> list[dict]:
        return _jsonl(self.learner_dir / "work.jsonl")

    def fates(self, since: float = 0.0) -> list[dict]:
        return [e for e in self.ledger() if e["event"] == "fate" and e["time"] >= since]

    def syncer_status(self) -> dict:
        return read_json(self.run_dir / "syncer_status.json") or {}

    def fault(self, fault: ActiveFault) -> tuple[float, float]:
        """Switch `fault` on now; returns (start, until) in wall time."""
        start = time.time()
        write_control(self.control, [fault])
        return start, fault.until


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():  # the process has not written it yet
        return []
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:  # a line being written right now
            continue
    return lines


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("chaos_injectors")
    run_dir = base / "run"
    procs = Processes(base / "logs")
    try:
        # --round-files all: a test replays the whole round log from the genesis.
        syncer = procs.start("syncer", "syncer", "--run-dir", str(run_dir), *RUN_FLAGS, "--round-files", "all")
        info = wait_until(lambda: read_json(run_dir / "syncer.json"), "syncer.json", alive=[syncer])
        address = info["address"]
        control = control_path(base / "control")
        learner = procs.start("learner", "learner", "--syncer", address, "--learner-id", "0", "--run-dir", str(run_dir),
                              "--threads", "1", "--status-every-s", "0.2", "--chaos-control", str(control))
        handle = Run(run_dir, syncer, learner, control)
        wait_until(lambda: sum(f["fate"] == "accepted" for f in handle.fates()) >= 5, "accepted updates",
                   alive=[syncer, learner])
        yield handle
    finally:
        procs.kill_all()


def _window(fates: list[dict], start: float, until: float) -> list[dict]:
    return [f for f in fates if start + REFRESH_S * 3 <= f["time"] < until]


def _accepted_after(run: Run, until: float) -> None:
    write_control(run.control, [])
    wait_until(lambda: any(f["fate"] == "accepted" for f in run.fates(since=until)), "an accepted update afterwards",
               alive=[run.syncer, run.learner])


def _publish_to_fate_s(run: Run, start: float, until: float) -> list[float]:
    """Seconds from publish to fate of the updates published inside the window."""
    ledger = run.ledger()
    published = {(e["fragment"], e["inner_step"]): e["time"] for e in ledger if e["event"] == "publish"
                 and start + REFRESH_S * 3 <= e["time"] < until}
    return [f["time"] - published[key] for f in ledger if f["event"] == "fate"
            and (key := (f["fragment"], f["inner_step"])) in published]


def test_drop_loses_every_update_in_its_window_and_then_updates_are_accepted_again(run):
    start, until = run.fault(ActiveFault("drop", time.time() + WINDOW_S, 1.0))
    wait_until(lambda: time.time() > until, "the end of the drop window", alive=[run.syncer, run.learner])
    in_window = _window(run.fates(), start, until)
    assert in_window and all((f["fate"], f["reason"]) == ("dropped", "drop") for f in in_window), in_window
    _accepted_after(run, until)


def test_corrupt_updates_are_rejected_as_corrupt_by_the_syncer_and_counted(run):
    corrupt_before = run.syncer_status().get("rejections", {}).get("corrupt", 0)
    start, until = run.fault(ActiveFault("corrupt", time.time() + WINDOW_S, 1.0))
    wait_until(lambda: time.time() > until, "the end of the corrupt window", alive=[run.syncer, run.learner])
    in_window = _window(run.fates(), start, until)
    # Whichever comes first after the switch is corrupted: an update (rejected as corrupt) or a version
    # on its way down (the learner re-joins, and its updates meet `unknown_learner`, checked before
    # their bytes, until a Welcome gets through intact). Nothing in the window is accepted.
    reasons = [f["reason"] for f in in_window if f["fate"] == "rejected"]
    assert len(reasons) == len(in_window) and set(reasons) <= {"corrupt", "unknown_learner"}, in_window
    wait_until(lambda: run.syncer_status().get("rejections", {}).get("corrupt", 0)
               >= corrupt_before + reasons.count("corrupt"), "the corrupt rejections counted", alive=[run.syncer])
    _accepted_after(run, until)


def test_latency_delays_every_update_by_at_least_the_added_latency(run):
    latency_s = 0.6
    start, until = run.fault(ActiveFault("latency", time.time() + WINDOW_S, latency_s))
    wait_until(lambda: time.time() > until + latency_s, "the end of the latency window",
               alive=[run.syncer, run.learner])
    delays = _publish_to_fate_s(run, start, until)
    assert delays and min(delays) >= latency_s, delays
    # Nothing is lost to latency; a learner that gave up waiting republishes from the same base, and
    # the syncer refuses that overlap as stale once the delayed first update has been merged.
    assert {(f["fate"], f["reason"]) for f in _window(run.fates(), start, until)} <= {("accepted", ""),
                                                                                     ("rejected", "stale")}
    _accepted_after(run, until)


def _update_bytes(run_dir: Path) -> list[int]:
    """Payload bytes of one update per fragment (the codec's exact encoded sizes)."""
    config = RunConfig.load(run_dir / "config.json")
    learner = Learner(config.diloco, learner_id=0, model=build_model(config.model))
    codec, numel = get_codec(config.diloco.codec), {n: p.numel() for n, p in learner.model.named_parameters()}
    return [sum(codec.encoded_nbytes(numel[n]) for n in names) for names in learner.plan.fragments]


def test_a_bandwidth_cap_holds_each_update_for_its_size_over_the_cap(run):
    sizes = _update_bytes(run.run_dir)
    cap = min(sizes) / 0.5  # at least half a second per update
    start, until = run.fault(ActiveFault("bandwidth", time.time() + 2 * WINDOW_S, cap))
    wait_until(lambda: len(_publish_to_fate_s(run, start, until)) >= 2, "capped updates delivered",
               alive=[run.syncer, run.learner])
    delays = _publish_to_fate_s(run, start, until)
    assert min(delays) >= min(sizes) / cap - 0.01, delays
    _accepted_after(run, until)


def _step_s(run: Run, start: float, until: float) -> list[float]:
    return [m["learner/0/step_s"] for m in _jsonl(run.learner_dir / "metrics.jsonl")
            if "learner/0/step_s" in m and start <= m["time"] < until]


def test_a_straggler_stretches_each_inner_step_by_the_factor(run):
    before = time.time()
    factor = 4.0
    start, until = run.fault(ActiveFault("straggler", time.time() + WINDOW_S, factor))
    wait_until(lambda: time.time() > until, "the end of the straggler window", alive=[run.syncer, run.learner])
    write_control(run.control, [])
    normal = statistics.median(_step_s(run, before - 3 * WINDOW_S, before))
    slowed = statistics.median(_step_s(run, start + REFRESH_S * 3, until))
    # Each slowed step takes factor x its own compute time, plus the delay in waking up from its sleep,
    # which on this shared 2-core machine can be as long as a tiny model's inner step (a few ms): a
    # lower bound with no slack for noise, an upper bound that still tells factor from factor^2.
    assert 0.75 * factor <= slowed / normal <= 2 * factor, (normal, slowed)


def test_a_partition_drops_updates_times_the_learner_out_and_it_rejoins_afterwards(run):
    joins_before = run.syncer_status()["learners"]["0"]["joins"]
    start, until = run.fault(ActiveFault("partition", time.time() + 5.0))
    wait_until(lambda: run.syncer_status().get("alive_learners") == [], "the syncer times the learner out",
               alive=[run.syncer, run.learner])
    assert time.time() < until
    wait_until(lambda: time.time() > until, "the end of the partition", alive=[run.syncer, run.learner])
    in_window = _window(run.fates(), start, until)
    assert in_window and all((f["fate"], f["reason"]) == ("dropped", "partition") for f in in_window), in_window
    wait_until(lambda: run.syncer_status()["learners"]["0"]["joins"] > joins_before
               and run.syncer_status()["alive_learners"] == [0], "the learner re-joined",
               alive=[run.syncer, run.learner])
    _accepted_after(run, until)
    # status.json is rewritten periodically (every 0.2 s here): wait for the write after the re-join.
    status = lambda: read_json(run.learner_dir / "status.json") or {}
    wait_until(lambda: status().get("joins", 0) >= 2, "the learner's status to count the re-join",
               alive=[run.syncer, run.learner])
    assert status()["updates_dropped"] >= len(in_window)


def test_after_every_fault_each_publish_has_one_fate_and_the_state_replays(run):
    for popen in (run.learner, run.syncer):
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(timeout=PROCESS_WAIT_S) == 0
    ledger = run.ledger()
    assert [e["event"] for e in ledger].count("start") == 1 and ledger[-1]["event"] == "end"
    publishes = [(e["fragment"], e["inner_step"]) for e in ledger if e["event"] == "publish"]
    fates = [(e["fragment"], e["inner_step"]) for e in ledger if e["event"] == "fate"]
    assert sorted(fates) == sorted(publishes)
    # The same work goes out twice only after a Welcome: when the syncer had forgotten the learner (a partition past
    # the heartbeat timeout), refused as unknown_learner, it is sent again after the re-join's Welcome; and a Welcome
    # at the version an update was published from publishes it again at once (the learner cannot tell an update in
    # flight from one the syncer lost: a CI run's re-join crossed an update in flight, and the copy was refused as
    # stale). Either way the syncer accepts the work once.
    fates_of: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for e in ledger:
        if e["event"] == "fate":
            fates_of.setdefault((e["fragment"], e["inner_step"]), []).append((e["fate"], e["reason"]))
    assert all(fates.count(("accepted", "")) <= 1 for fates in fates_of.values()), fates_of
    for key in [key for key, count in Counter(publishes).items() if count > 1]:
        at = [i for i, e in enumerate(ledger) if e["event"] == "publish" and (e["fragment"], e["inner_step"]) == key]
        for before, again in itertools.pairwise(at):
            assert any(e["event"] == "welcome" for e in ledger[before:again]), (key, ledger[before:again + 1])
    kinds = {(e["fate"], e["reason"]) for e in ledger if e["event"] == "fate"}
    assert {("accepted", ""), ("dropped", "drop"), ("dropped", "partition")} <= kinds

    # The syncer's verdicts are the ledger's: accepted updates, and corrupt ones with their inner steps.
    events = _jsonl(run.run_dir / "syncer" / "metrics.jsonl")
    assert events[0]["event"] == "start" and events[0]["source"] == "init" and events[0]["rounds_committed"] == 0
    accepted = {(e["fragment"], e["inner_step"]) for e in ledger if e["event"] == "fate" and e["fate"] == "accepted"}
    assert {(e["fragment"], e["inner_step"]) for e in events if e.get("event") == "update" and e["accepted"]} \
        == accepted
    corrupt = {(e["fragment"], e["inner_step"]) for e in ledger if e["event"] == "fate" and e["reason"] == "corrupt"}
    assert {(e["fragment"], e["inner_step"]) for e in events
            if e.get("event") == "rejection" and e["reason"] == "corrupt"} == corrupt
    # Every accepted update is merged by a round that names it, or was held when the syncer stopped.
    merged = {(line["fragment"], p["inner_step"]) for line in RoundLog(run.run_dir).lines()
              for p in line["participants"]}
    discarded = {(e["fragment"], e["inner_step"]) for e in events if e.get("event") == "discarded"}
    assert merged | discarded == accepted and not merged & discarded

    records = list(RoundLog(run.run_dir).records())
    config = RunConfig.load(run.run_dir / "config.json")
    replayed = replay_rounds(config.diloco, initial_params(config), records)
    state, _, serial = load_latest_state(run.run_dir / "checkpoints" / "syncer")
    assert serial == len(records)
    assert all(torch.equal(state["global"][name], tensor) for name, tensor in replayed.items())


TWO_LEARNERS = RunConfig(model=ModelConfig(width=32, num_heads=2, num_layers=1, context_len=32),
                         data=DataConfig(context_len=32, batch_size=4),
                         diloco=DilocoConfig(num_fragments=2, sync_every=4), num_learners=2)


def _next_message(io: LearnerIO, kind: type, skipped: list | None = None):
    """The next message of `kind` in the learner's inbox; the ones before it go to `skipped`."""
    deadline = time.monotonic() + PROCESS_WAIT_S
    while time.monotonic() < deadline:
        io.inbox.wait(timeout_s=0.5)
        for message in io.inbox.take_ready():
            if isinstance(message, kind):
                return message
            if skipped is not None:
                skipped.append(message)
    pytest.fail(f"no {kind.__name__} from the syncer")


@contextlib.contextmanager
def two_learners(tmp_path, control: Path):
    """A syncer service in this process behind real gRPC on loopback, and two joined learners' I/O
    threads (learner 0 obeys `control`). Yields (service, learner cores, their LearnerIOs, fates of
    learner 0 as (fragment, inner_step, fate, reason))."""
    syncer = Syncer(TWO_LEARNERS.diloco, TWO_LEARNERS.quorum, initial_params=initial_params(TWO_LEARNERS))
    sink = MemorySink()
    service = SyncerService(TWO_LEARNERS, syncer, SyncerStore(tmp_path), sink=sink,
                            config=SyncerServiceConfig())
    server, port = start_server(service, "127.0.0.1:0", token=None)
    service.start(f"127.0.0.1:{port}")
    fates: list[tuple] = []
    ios = []
    try:
        cores = [Learner(TWO_LEARNERS.diloco, learner_id=i, model=build_model(TWO_LEARNERS.model)) for i in range(2)]
        for core, faults in zip(cores, (ChaosControl(control, seed=0), NO_FAULTS), strict=True):
            client = SyncerClient(f"127.0.0.1:{port}", model=WireModel(core.spec, core.plan, "int4"),
                                  diloco_config=TWO_LEARNERS.diloco, link=unlimited_link(faults=faults))
            ios.append(LearnerIO(client, core.join_message(), heartbeat_every_s=0.2,
                                 on_fate=lambda u, fate, why: fates.append((u.fragment, u.inner_step, fate, why))))
            ios[-1].start()
            core.receive(_next_message(ios[-1], Welcome))
        yield service, sink, cores, ios, fates
    finally:
        for io in ios:
            io.close(leave=True)
        service.close(server)


def _due_update(core: Learner):
    """The next update of a joined learner core, its model moved a little first: a zero pseudo-gradient is valid, but
    its tensors travel as their headers alone (`ddiloco.zero_encodings`), leaving no byte for a fault to corrupt."""
    with torch.no_grad():
        for param in core.model.parameters():
            param.add_(1e-3)
    while not (updates := core.after_inner_step(tokens=1)):
        pass
    return updates[0]


def test_a_corrupted_update_is_rejected_as_corrupt_and_a_corrupted_version_makes_the_learner_rejoin(tmp_path):
    control = control_path(tmp_path / "control")
    with two_learners(tmp_path, control) as (service, sink, cores, (corrupted, other), fates):
        write_control(control, [ActiveFault("corrupt", time.time() + 60, 1.0)])
        wait_until(lambda: corrupted.client.link.faults.should_corrupt(), "the corrupt fault")
        update = _due_update(cores[0])
        corrupted.send(update)
        wait_until(lambda: fates, "the fate of the corrupted update")
        assert fates == [(update.fragment, update.inner_step, "rejected", "corrupt")]
        assert service.status()["rejections"] == {"corrupt": 1} and service.syncer.rounds_committed == 0
        (event,) = [e for e in sink.events if e["kind"] == "rejection"]
        assert (event["reason"], event["fragment"], event["inner_step"]) == ("corrupt", update.fragment,
                                                                              update.inner_step)
        # A version on its way down is corrupted as well: the learner drops it and re-joins, and
        # (while the fault lasts) every Welcome fails its CRC too.
        other.send(_due_update(cores[1]))
        wait_until(lambda: service.syncer.rounds_committed == 1, "learner 1's round")
        wait_until(lambda: corrupted.stats.welcomes == 1 and not service.is_member(0), "learner 0 dropped the version")
        write_control(control, [])
        wait_until(lambda: corrupted.stats.welcomes == 2, "learner 0 re-joined once the fault was over")
        assert isinstance(_next_message(corrupted, Welcome), Welcome)


def test_a_version_sent_during_a_partition_is_discarded_and_the_learner_rejoins_once_healed(tmp_path):
    control = control_path(tmp_path / "control")
    with two_learners(tmp_path, control) as (_, _, cores, (cut_off, other), _):
        write_control(control, [ActiveFault("partition", time.time() + 1.5)])
        wait_until(lambda: cut_off.client.link.faults.partitioned(), "the partition")
        update = _due_update(cores[1])  # learner 1 alone closes a round
        other.send(update)
        _next_message(other, FragmentDelta)  # the round's version, sent to both learners
        wait_until(lambda: cut_off.client.link.faults.partitioned() is False, "the end of the partition")
        # The partitioned learner never saw that version: it re-joins, and the Welcome carries it.
        skipped: list = []
        welcome = _next_message(cut_off, Welcome, skipped)
        assert skipped == [] and cut_off.stats.welcomes == 2
        assert [s.version for s in welcome.fragments][update.fragment] == 1
