"""The Decoupled DiLoCo driver of the virtual-time harness: M learners and the syncer on one clock.

Drives the real `Learner` and `Syncer` cores through their public API only, the way
`ddiloco.inprocess.InProcessHub` does, but with time: every inner step is really computed
(`ddiloco.training.inner_step` on the learner's TinyGPT, AdamW and data shard) and lasts a virtual
duration drawn by `ddiloco.sim.cluster.StepTimer`; every message crosses a simulated link
(`ddiloco.sim.links`) with latency and bandwidth, per direction; learners fail and recover by a
`ddiloco.sim.faults.FaultPlan`. Synchronous (Streaming) DiLoCo is this driver with
`QuorumConfig(min_quorum=M, grace="none")`.

Rules the driver keeps (they mirror the real runtime):

- The learner's rules between messages are `ddiloco.learner_rules.LearnerRules`, the same object the
  real runtime (`ddiloco.session`) drives: when to train or wait (bounded by `LearnerConfig.max_wait_s`),
  where a new incarnation resumes, the final flush. Messages that reach a learner while it computes an
  inner step wait in its inbox and are applied before its next inner step; a learner that is idle
  (joining, or blocked by the tau waiting rule) applies them on arrival.
- Learners send `heartbeat()` every `LearnerConfig.heartbeat_every_s` of virtual time; the syncer's
  `advance` runs at its `next_deadline()`, so silent learners time out and grace windows end on time.
- A `Commit` is appended to the round log (durable) before the sends that follow it.
- A failed learner loses its in-flight messages in both directions and its local progress; on
  recovery a NEW `Learner` with a freshly initialised model and a fresh inner optimizer joins (the
  self-healing path of the real runtime, without a checkpoint) and loads the global state from the
  syncer's `Welcome`; its data cursor continues where the failed one stopped. Having no position of
  its own, it takes the global schedule position that Welcome implies (`LearnerRules`). Messages the
  syncer sends to a learner id before the new incarnation's `Join` has reached it go to the dead
  connection and are lost.
- The merged fragments' arrival times are reported with `Syncer.observe_sync_time` (adaptive grace).
- Learners stop when the token budget is spent, publish their last work (`LearnerRules.finish`), send
  `Leave`, and the driver lets every message in flight arrive, so the last rounds commit; the final
  global model is evaluated after that.

The driver owns the learners' events, the failures and the links between learners and syncer; the syncer's
side (its `receive`, its timer, its commits and the round log) is `ddiloco.sim.syncer_node.SyncerNode`, and
what it keeps per learner id across incarnations is `ddiloco.sim.learner_slot.LearnerSlot`.

Paper: Decoupled DiLoCo, arXiv 2604.21428. Metric definitions: `ddiloco.goodput` (what the harness books:
`ddiloco.sim.accounting`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddiloco.config import DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.data import load_corpus, shard_stream
from ddiloco.fault_plan import Fault
from ddiloco.goodput import EventLog
from ddiloco.learner import Learner
from ddiloco.learner_rules import Action, LearnerRules
from ddiloco.messages import FragmentDelta, FragmentState, Join, Leave, Update, Welcome
from ddiloco.sim.accounting import (
    CurvePoint,
    FragmentWork,
    PeakMeter,
    SimResult,
    add_final_point,
    core_metrics,
    event_log,
    union_length,
)
from ddiloco.sim.cluster import ClusterConfig, StepTimer
from ddiloco.sim.engine import EventLoop
from ddiloco.sim.faults import FaultPlan, harness_plan, outage_faults, outages_json
from ddiloco.sim.learner_slot import LearnerSlot
from ddiloco.sim.links import Link, describe_message, message_nbytes, payload_nbytes
from ddiloco.sim.syncer_node import RoundObserver, SyncerNode
from ddiloco.sim.workload import Evaluator, WorkloadConfig, eval_schedule, seeded_model
from ddiloco.syncer import Syncer
from ddiloco.training import inner_step, make_inner_optimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DecoupledSimConfig:
    """One Decoupled DiLoCo (or synchronous DiLoCo) run in the harness."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    seed: int = 0
    """Seeds the global model (the syncer's), each learner's models and step-time jitter."""


class DecoupledSim:
    """Runs one Decoupled DiLoCo configuration under a fault plan; `run()` returns a `SimResult`."""

    def __init__(self, config: DecoupledSimConfig, *, faults: FaultPlan | None = None, name: str = "decoupled",
                 corpus: bytes | None = None, observers: Sequence[RoundObserver] = ()) -> None:
        self.config = config
        self.faults = harness_plan(faults, config.cluster.num_learners)
        self.name = name
        cluster, workload = config.cluster, config.workload
        corpus = load_corpus() if corpus is None else corpus
        self.loop = EventLoop()
        self.initial_params = {n: p.detach().clone()
                               for n, p in seeded_model(workload.model, config.seed).named_parameters()}
        self.syncer = Syncer(config.diloco, config.quorum, initial_params=self.initial_params)
        plan = self.syncer.plan
        sizes = {name: t.numel() for name, t in self.initial_params.items()}
        total = sum(sizes.values())
        shares = [sum(sizes[n] for n in names) / total for names in plan.fragments]
        self.evaluator = Evaluator(workload, corpus=corpus)
        self.slots = [
            LearnerSlot(learner_id=m, uplink=Link(cluster.uplink), downlink=Link(cluster.downlink),
                        timer=StepTimer(cluster, learner_id=m, seed=config.seed),
                        stream=shard_stream(corpus, workload.data, shard=m, num_shards=cluster.num_learners))
            for m in range(cluster.num_learners)]
        self.work = FragmentWork(shares, cluster.num_learners)
        self.node = SyncerNode(self.syncer, loop=self.loop, work=self.work, shares=shares, send_down=self._send_down,
                               observers=observers)
        self.budget_tokens = workload.token_budget(cluster.num_learners)
        self.claimed_tokens = 0
        self.tokens_processed = 0
        self._eval_marks = eval_schedule(self.budget_tokens, workload.eval_points)
        self.curve: list[CurvePoint] = []
        self.start_s: float | None = None
        self.end_s = 0.0
        self.peak_up = PeakMeter(cluster.step_time_s)
        self.peak_down = PeakMeter(cluster.step_time_s)
        self.payload_up = 0
        self.payload_down = 0

    # ---- the run ---------------------------------------------------------------------------------

    def run(self) -> SimResult:
        loop = self.loop
        self._evaluate()
        for slot in self.slots:
            self._start_incarnation(slot)
            outages = self.faults.for_learner(slot.learner_id)
            if outages:
                self._schedule_outage(outages[0])
        loop.run()
        for slot in self.slots:
            slot.close_up_interval(self.end_s)
        self.work.finish()
        final_loss = self.evaluator.loss(self.syncer.global_params())
        add_final_point(self.curve, CurvePoint(self.tokens_processed, self.end_s, final_loss))
        loop.record("final", val_loss=final_loss, rounds=self.syncer.rounds_committed)
        events = self._event_log()
        return SimResult(system=self.name, metrics=self._metrics(events, final_loss), curve=self.curve, log=loop.log,
                         final_params=self.syncer.global_params(), round_log=self.node.round_log,
                         settings=self._settings(), events=events)

    @property
    def budget_spent(self) -> bool:
        return self.claimed_tokens + self.config.workload.tokens_per_step > self.budget_tokens

    # ---- learners --------------------------------------------------------------------------------

    def _start_incarnation(self, slot: LearnerSlot) -> None:
        m = slot.learner_id
        workload = self.config.workload
        model = seeded_model(workload.model, slot.model_seed(self.config.seed))
        optimizer = make_inner_optimizer(model, workload.inner)
        slot.learner = Learner(self.config.diloco, learner_id=m, model=model, optimizer=optimizer,
                               max_tokens_per_step=workload.tokens_per_step)
        quorum, learners = self.config.quorum.min_quorum, self.config.cluster.num_learners
        slot.rules = LearnerRules(slot.learner, self.config.learner, synchronous=quorum >= learners > 1)
        slot.incarnations += 1
        slot.state = "joining"
        slot.inbox.clear()
        slot.up_since = self.loop.now
        self.loop.record("incarnation", learner=m, generation=slot.generation, incarnation=slot.incarnations)
        self._send_up(slot, slot.learner.join_message())
        self.loop.schedule(self.loop.now + self.config.learner.heartbeat_every_s, "heartbeat", self._on_heartbeat,
                           m=m, generation=slot.generation)

    def _try_step(self, slot: LearnerSlot) -> None:
        """Between inner steps: apply the inbox, then step, block, or finish."""
        learner = slot.learner
        assert learner is not None
        inbox, slot.inbox = slot.inbox, []
        for message in inbox:
            self._apply(slot, message)
        if slot.state == "done":
            return
        if self.budget_spent:
            self._finish(slot)
            return
        assert slot.rules is not None
        abandoned_before = learner.stats.waits_abandoned
        blocking = learner.blocking_fragments()
        nxt = slot.rules.next(self.loop.now)
        if nxt.action is Action.JOIN:
            slot.state = "joining"
            return
        if learner.stats.waits_abandoned > abandoned_before:
            slot.waits_abandoned += learner.stats.waits_abandoned - abandoned_before
            slot.unblock(self.loop.now)
            self.loop.record("stop_waiting", learner=slot.learner_id, fragments=blocking)
        if nxt.action is Action.WAIT:
            if slot.state != "blocked":
                slot.state = "blocked"
                slot.wait_started_at = self.loop.now
                self.loop.record("blocked", learner=slot.learner_id, fragments=blocking)
            slot.wait_token += 1
            self.loop.schedule(nxt.until, "wait_timeout", self._on_wait_timeout, m=slot.learner_id,
                               generation=slot.generation, token=slot.wait_token)
            return
        slot.unblock(self.loop.now)
        slot.state = "stepping"
        slot.step_started_at = self.loop.now
        if self.start_s is None:
            self.start_s = self.loop.now
        self.claimed_tokens += self.config.workload.tokens_per_step
        duration = slot.timer.next_duration_s()
        self.loop.schedule(self.loop.now + duration, "step_done", self._on_step_done, m=slot.learner_id,
                           generation=slot.generation)

    def _on_step_done(self, m: int, generation: int) -> None:
        slot = self.slots[m]
        if generation != slot.generation or slot.state != "stepping":
            return
        learner = slot.learner
        assert learner is not None
        now = self.loop.now
        batch = slot.stream.next_batch()
        workload = self.config.workload
        workload.apply_lr(learner.optimizer, spent_tokens=self.claimed_tokens - workload.tokens_per_step,
                          num_learners=self.config.cluster.num_learners)
        loss = inner_step(learner.model, learner.optimizer, batch, grad_clip=self.config.workload.inner.grad_clip)
        updates = learner.after_inner_step(batch.tokens)
        duration = now - slot.step_started_at
        slot.step_intervals.append((slot.step_started_at, now))
        slot.steps_done += 1
        slot.tokens_processed += batch.tokens
        self.claimed_tokens += batch.tokens - self.config.workload.tokens_per_step
        self.tokens_processed += batch.tokens
        self.end_s = now
        self.work.step(m, duration)
        self.loop.record("step", learner=m, inner_step=learner.inner_step, loss=loss, duration_s=duration,
                         updates=[u.fragment for u in updates])
        for update in updates:
            p = update.fragment
            self.work.published(m, slot.generation, p, update.inner_step)
            self.peak_up.add(m, now, update.payload_bytes)
            self._send_up(slot, update)
        while self._eval_marks and self.tokens_processed >= self._eval_marks[0]:
            self._eval_marks.pop(0)
            self._evaluate()
        self._try_step(slot)

    def _on_wait_timeout(self, m: int, generation: int, token: int) -> None:
        slot = self.slots[m]
        if generation != slot.generation or slot.state != "blocked" or token != slot.wait_token:
            return
        self._try_step(slot)  # the rules stop waiting once their bound has passed

    def _on_heartbeat(self, m: int, generation: int) -> None:
        slot = self.slots[m]
        if generation != slot.generation or slot.state in ("down", "done"):
            return
        assert slot.learner is not None
        if slot.learner.joined:
            self._send_up(slot, slot.learner.heartbeat())
        self.loop.schedule(self.loop.now + self.config.learner.heartbeat_every_s, "heartbeat", self._on_heartbeat,
                           m=m, generation=generation)

    def _finish(self, slot: LearnerSlot) -> None:
        slot.unblock(self.loop.now)
        slot.state = "done"
        slot.close_up_interval(self.loop.now)
        assert slot.rules is not None
        for update in slot.rules.finish():  # the last work of every fragment, before leaving
            self.work.published(slot.learner_id, slot.generation, update.fragment, update.inner_step)
            self.peak_up.add(slot.learner_id, self.loop.now, update.payload_bytes)
            self._send_up(slot, update)
        self.loop.record("leave", learner=slot.learner_id)
        self._send_up(slot, Leave(slot.learner_id))

    # ---- failures --------------------------------------------------------------------------------

    def _schedule_outage(self, outage: Fault) -> None:
        self.loop.schedule(outage.at_s, "fail", self._on_fail, outage=outage)

    def _on_fail(self, outage: Fault) -> None:
        assert outage.target is not None
        slot = self.slots[outage.target]
        if slot.state == "done":
            return
        slot.unblock(self.loop.now)
        slot.close_up_interval(self.loop.now)
        self.work.crashed(slot.learner_id)
        if slot.state == "stepping":
            self.claimed_tokens -= self.config.workload.tokens_per_step
            slot.step_intervals.append((slot.step_started_at, self.loop.now))  # computing until the crash
        slot.crash(self.loop.now)
        self.loop.record("fail", learner=outage.target, until_s=outage.end_s)
        logger.info("[learner %d | t %.1f s] failed, down until %.1f s", outage.target, self.loop.now,
                    outage.end_s)
        self.loop.schedule(outage.end_s, "recover", self._on_recover, outage=outage)

    def _on_recover(self, outage: Fault) -> None:
        assert outage.target is not None
        slot = self.slots[outage.target]
        self.loop.record("recover", learner=outage.target)
        if self.budget_spent:
            slot.state = "done"
            return
        self._start_incarnation(slot)
        later = [o for o in self.faults.for_learner(outage.target) if o.at_s >= outage.end_s]
        if later:
            self._schedule_outage(later[0])

    # ---- messages --------------------------------------------------------------------------------

    def _send_up(self, slot: LearnerSlot, message: Any) -> None:
        nbytes = message_nbytes(message)
        self.payload_up += payload_nbytes(message)
        arrival = slot.uplink.send(self.loop.now, nbytes)
        self.loop.record("send_up", learner=slot.learner_id, message=describe_message(message), bytes=nbytes,
                         arrival_s=arrival)
        self.loop.schedule(arrival, "deliver_up", self._on_deliver_up, m=slot.learner_id,
                           generation=slot.generation, message=message)

    def _on_deliver_up(self, m: int, generation: int, message: Any) -> None:
        slot = self.slots[m]
        if generation != slot.generation:
            self.loop.record("drop_up", learner=m, message=describe_message(message))
            if isinstance(message, Update):
                self.work.arrived(m, generation, message.fragment, message.inner_step, outcome="crashed")
            return
        if isinstance(message, Join):
            slot.syncer_generation = generation
        self.node.receive(message, learner_id=m, generation=generation)

    def _send_down(self, m: int, message: Any, *, committed_at: float | None = None) -> None:
        slot = self.slots[m]
        if slot.state == "down" or slot.syncer_generation != slot.generation:
            self.loop.record("drop_down", learner=m, message=describe_message(message))
            return
        nbytes = message_nbytes(message)
        self.payload_down += payload_nbytes(message)
        if isinstance(message, FragmentState | FragmentDelta):
            self.peak_down.add(m, self.loop.now, message.payload_bytes)
        arrival = slot.downlink.send(self.loop.now, nbytes)
        self.loop.record("send_down", learner=m, message=describe_message(message), bytes=nbytes, arrival_s=arrival)
        self.loop.schedule(arrival, "deliver_down", self._on_deliver_down, m=m, generation=slot.generation,
                           message=message, committed_at=committed_at)

    def _on_deliver_down(self, m: int, generation: int, message: Any, committed_at: float | None) -> None:
        slot = self.slots[m]
        if generation != slot.generation or slot.state in ("down", "done"):
            self.loop.record("drop_down", learner=m, message=describe_message(message))
            return
        if committed_at is not None:
            self.syncer.observe_sync_time(self.loop.now - committed_at)
        if slot.state == "stepping":
            slot.inbox.append(message)
            return
        self._apply(slot, message)
        if slot.state in ("joining", "blocked") and slot.learner is not None and slot.learner.can_step:
            slot.unblock(self.loop.now)
            self._try_step(slot)

    def _apply(self, slot: LearnerSlot, message: Any) -> None:
        learner, rules = slot.learner, slot.rules
        assert learner is not None and rules is not None
        before = list(learner.versions)
        position = (learner.inner_step, learner.schedule.next_round)
        replies = rules.receive(message, self.loop.now)
        if isinstance(message, Welcome) and (learner.inner_step, learner.schedule.next_round) != position:
            self.loop.record("schedule_position", learner=learner.learner_id, inner_step=learner.inner_step,
                             next_round=learner.schedule.next_round)
        for reply in replies:
            if isinstance(reply, Update):  # published before the state overwrote the fragment: it carries that work
                self.work.published(slot.learner_id, slot.generation, reply.fragment, reply.inner_step)
                self.peak_up.add(slot.learner_id, self.loop.now, reply.payload_bytes)
        for p, (old, new) in enumerate(zip(before, learner.versions, strict=True)):
            if new != old or isinstance(message, Welcome):
                self.work.overwritten(slot.learner_id, p)
        self.loop.record("apply", learner=slot.learner_id, message=describe_message(message))
        for reply in replies:
            self._send_up(slot, reply)

    # ---- results ---------------------------------------------------------------------------------

    def _evaluate(self) -> None:
        loss = self.evaluator.loss(self.syncer.global_params())
        self.curve.append(CurvePoint(self.tokens_processed, self.loop.now, loss))
        self.loop.record("eval", tokens=self.tokens_processed, val_loss=loss)

    def _event_log(self) -> EventLog:
        """The run in the `ddiloco.goodput` schema; its uptime bin is one sync period of nominal steps."""
        return event_log(self.work.seconds, num_learners=len(self.slots), start_s=self.start_s or 0.0,
                         end_s=self.end_s, uptime_bin_s=self.config.diloco.sync_every * self.config.cluster.step_time_s,
                         advances=self.node.advances, faults=outage_faults(self.faults))

    def _metrics(self, events: EventLog, final_loss: float) -> dict[str, Any]:
        start_s, end_s = events.start_s, events.end_s
        busy = [iv for slot in self.slots for iv in slot.step_intervals]
        metrics = core_metrics(events, final_loss=final_loss, tokens_processed=self.tokens_processed,
                               tokens_merged=self.node.tokens_merged)
        alive_s = union_length([(max(a, start_s), b) for slot in self.slots for a, b in slot.up_intervals],
                               end_s=end_s)
        allocated_s = len(self.slots) * (end_s - start_s)
        steady_s = start_s + self.config.diloco.sync_every * self.config.cluster.step_time_s
        metrics.update({
            "uptime_while_alive": union_length(busy, end_s=end_s) / alive_s if alive_s else 0.0,
            "bytes_up": sum(slot.uplink.bytes_sent for slot in self.slots),
            "bytes_down": sum(slot.downlink.bytes_sent for slot in self.slots),
            "payload_bytes_up": self.payload_up,
            "payload_bytes_down": self.payload_down,
            "peak_bytes_per_step_up": self.peak_up.peak(steady_s, end_s),
            "peak_bytes_per_step_down": self.peak_down.peak(steady_s, end_s),
            "max_bytes_per_step_up": self.peak_up.peak(),
            "max_bytes_per_step_down": self.peak_down.peak(),
            **self.node.round_metrics(),
            "blocked_fraction": sum(s.blocked_s for s in self.slots) / allocated_s if allocated_s else 0.0,
            "waits_abandoned": sum(s.waits_abandoned for s in self.slots),
            "participation": {
                str(slot.learner_id): {
                    "rounds": self.node.share_of_rounds(slot.learner_id),
                    "inner_steps": slot.steps_done,
                    "tokens_processed": slot.tokens_processed,
                    "incarnations": slot.incarnations,
                    "down_s": self.faults.down_s(slot.learner_id, end_s),
                } for slot in self.slots},
        })
        return metrics

    def _settings(self) -> dict[str, Any]:
        config = self.config
        return {"workload": config.workload.to_dict(), "cluster": dataclasses.asdict(config.cluster),
                "diloco": config.diloco.to_dict(), "quorum": config.quorum.to_dict(),
                "learner": config.learner.to_dict(), "seed": config.seed, "faults": outages_json(self.faults)}
