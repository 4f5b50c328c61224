"""Synchronous data-parallel baselines in the virtual-time harness: non-elastic and elastic.

Data-parallel is a different algorithm from DiLoCo, so it has its own loop here, built from the same
pieces as every other driver: the same TinyGPT (`ddiloco.sim.workload.seeded_model`), the same shards
(replica i reads shard i of M, like learner i), the same `InnerConfig`, and `ddiloco.training.
inner_step`. The M replicas average their gradients every step; since every replica's batch has the
same size, that average is exactly the gradient of one model on the M local batches laid side by side,
which is what is computed (one `inner_step` on the concatenated batch: global batch = M x local).

Time per global step: the slowest participating replica's step time (`ddiloco.sim.cluster.StepTimer`,
same speeds and jitter as the learners), plus a ring all-reduce of the float32 gradients over the
job's interconnect (`DataParallelConfig.allreduce`, by default a datacenter fabric, so communication
costs data-parallel almost nothing: the comparison is about failures, not bandwidth).

Failures (same `FaultPlan` as the other systems; arXiv 2604.21428, section 4):

- **non-elastic**: one replica failing kills the job. The step in progress is lost; everyone waits
  until the failed replica is back (its outage ends), then `restart_s` to relaunch, and training
  resumes from the last checkpoint (taken every `checkpoint_every_steps` global steps, for free):
  the steps since then are recomputed (model, optimizer and data cursors are restored).
- **elastic**: the survivors continue after a reconfiguration pause `downscale_s` with a smaller
  global batch; the step in progress is lost. A returning replica is re-admitted at the next step
  boundary after an `upscale_s` pause for everyone.

Metrics are `ddiloco.goodput`'s (what the harness books: `ddiloco.sim.accounting`): goodput counts each
participating replica's compute time of steps that stay in the model; the global model advances with
every step above every earlier step number (a step done again after a rollback is not progress), and
uptime is measured in bins of `uptime_bin_s` (default one sync period of the default H, so that it
compares with the DiLoCo systems of an experiment; `ddiloco.sim.experiments` passes its own H).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.config import DilocoConfig
from ddiloco.data import Batch, load_corpus, shard_stream
from ddiloco.data_parallel import ring_allreduce_bytes, ring_allreduce_s
from ddiloco.goodput import Advance, EventLog
from ddiloco.sim.accounting import CurvePoint, SimResult, WorkSeconds, add_final_point, core_metrics, event_log
from ddiloco.sim.cluster import ClusterConfig, StepTimer
from ddiloco.sim.engine import EventLoop
from ddiloco.sim.faults import FaultPlan, harness_plan, outage_faults, outages_json
from ddiloco.sim.links import LinkConfig
from ddiloco.sim.workload import Evaluator, WorkloadConfig, eval_schedule, seeded_model
from ddiloco.training import inner_step, make_inner_optimizer

GRADIENT_BYTES_PER_VALUE = 4
"""Gradients are all-reduced in float32."""


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """How the data-parallel job communicates and what a failure costs it."""

    elastic: bool = False
    """False: a failure stops everyone and the job restarts from a checkpoint; True: survivors go on."""
    checkpoint_every_steps: int = 50
    """Non-elastic: global steps between checkpoints (taken for free)."""
    restart_s: float = 30.0
    """Non-elastic: seconds to relaunch the job once every replica is back."""
    downscale_s: float = 10.0
    """Elastic: pause of the survivors to reconfigure without the failed replica."""
    upscale_s: float = 10.0
    """Elastic: pause of everyone to re-admit a returning replica."""
    allreduce: LinkConfig = field(default_factory=lambda: LinkConfig(latency_s=1e-5, bandwidth_bps=100e9))
    """The job's interconnect (per replica, per direction) for the ring all-reduce."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_every_steps, int) or self.checkpoint_every_steps < 1:
            raise ValueError(f"checkpoint_every_steps={self.checkpoint_every_steps!r} is invalid: "
                             "expected an integer >= 1")
        for name in ("restart_s", "downscale_s", "upscale_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number >= 0 (seconds)")


@dataclass(frozen=True, kw_only=True)
class DataParallelSimConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    seed: int = 0
    """Seeds the model (the same global initialisation as the Decoupled runs) and step-time jitter."""


def allreduce_s(link: LinkConfig, *, replicas: int, nbytes: int) -> float:
    """`ddiloco.data_parallel.ring_allreduce_s` over the job's interconnect."""
    return ring_allreduce_s(replicas, nbytes, latency_s=link.latency_s, bandwidth_bps=link.bandwidth_bps)


def allreduce_bytes(*, replicas: int, nbytes: int) -> int:
    """Bytes each replica sends (and receives) in one ring all-reduce (`ddiloco.data_parallel`)."""
    return int(ring_allreduce_bytes(replicas, nbytes))


def _concat(batches: list[Batch]) -> Batch:
    return Batch(inputs=torch.cat([b.inputs for b in batches]), targets=torch.cat([b.targets for b in batches]),
                 tokens=sum(b.tokens for b in batches))


class DataParallelSim:
    """Runs one data-parallel configuration under a fault plan; `run()` returns a `SimResult`."""

    def __init__(self, config: DataParallelSimConfig, *, faults: FaultPlan | None = None,
                 name: str | None = None, corpus: bytes | None = None, uptime_bin_s: float | None = None) -> None:
        self.config = config
        self.uptime_bin_s = (DilocoConfig().sync_every * config.cluster.step_time_s if uptime_bin_s is None
                             else uptime_bin_s)
        self.faults = harness_plan(faults, config.cluster.num_learners)
        dp = config.data_parallel
        self.name = name or ("elastic_data_parallel" if dp.elastic else "data_parallel")
        cluster, workload = config.cluster, config.workload
        corpus = load_corpus() if corpus is None else corpus
        num = cluster.num_learners
        self.loop = EventLoop()
        self.model = seeded_model(workload.model, config.seed)
        self.optimizer = make_inner_optimizer(self.model, workload.inner)
        self.streams = [shard_stream(corpus, workload.data, shard=i, num_shards=num) for i in range(num)]
        self.timers = [StepTimer(cluster, learner_id=i, seed=config.seed) for i in range(num)]
        self.evaluator = Evaluator(workload, corpus=corpus)
        self.model_bytes = sum(p.numel() for p in self.model.parameters()) * GRADIENT_BYTES_PER_VALUE
        self.work = WorkSeconds(num)
        self.budget_tokens = workload.token_budget(num)
        self._eval_marks = eval_schedule(self.budget_tokens, workload.eval_points)
        self.curve: list[CurvePoint] = []
        self.kept_tokens = 0
        self.tokens_processed = 0
        self.global_step = 0
        self.members = set(range(num))
        self.advances: list[Advance] = []
        self._high_step = 0
        """The highest global step ever reached: only a step above it advances the global model."""
        self._since_checkpoint: list[tuple[int, float]] = []  # (replica, seconds) of steps after it
        self._checkpoint = self._snapshot()
        self.failures = 0
        self.restarts = 0
        self.bytes_per_replica = [0] * num
        self.peak_bytes_per_step = 0

    # ---- the run ---------------------------------------------------------------------------------

    def run(self) -> SimResult:
        self._evaluate()
        tokens_per_replica = self.config.workload.tokens_per_step
        while self.kept_tokens < self.budget_tokens:
            if not self._ready():
                continue
            remaining = (self.budget_tokens - self.kept_tokens) // tokens_per_replica
            participants = sorted(self.members)[:remaining]
            self._step(participants)
        final_loss = self.evaluator.loss(dict(self.model.named_parameters()))
        add_final_point(self.curve, CurvePoint(self.kept_tokens, self.loop.now, final_loss))
        self.loop.record("final", val_loss=final_loss, global_steps=self.global_step)
        events = event_log(self.work, num_learners=self.config.cluster.num_learners, start_s=0.0,
                           end_s=self.loop.now, uptime_bin_s=self.uptime_bin_s, advances=self.advances,
                           faults=outage_faults(self.faults))
        final_params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return SimResult(system=self.name, metrics=self._metrics(events, final_loss), curve=self.curve,
                         log=self.loop.log, final_params=final_params, settings=self._settings(), events=events)

    def _down(self, replica: int, time_s: float) -> bool:
        return self.faults.is_down(replica, time_s)

    def _ready(self) -> bool:
        """At a step boundary: handle replicas that are down or back. False if time moved instead."""
        loop, dp = self.loop, self.config.data_parallel
        now = loop.now
        num = self.config.cluster.num_learners
        if not dp.elastic:
            down = [i for i in range(num) if self._down(i, now)]
            if down:
                self._restart(down)
                return False
            return True
        gone = [i for i in sorted(self.members) if self._down(i, now)]
        if gone:
            self.members.difference_update(gone)
            loop.record("downscale", replicas=gone)
            loop.clock.advance_to(now + dp.downscale_s)
            return False
        back = [i for i in range(num) if i not in self.members and not self._down(i, now)]
        if back:
            self.members.update(back)
            loop.record("upscale", replicas=back)
            loop.clock.advance_to(now + dp.upscale_s)
            return False
        if not self.members:
            # Everyone is down: wait for the first replica to come back.
            ends = [o.end_s for o in self.faults.outages if o.at_s <= now < o.end_s]
            loop.record("all_down")
            loop.clock.advance_to(min(ends))
            return False
        return True

    def _restart(self, down: list[int]) -> None:
        """Non-elastic: wait for every replica, relaunch, and roll back to the last checkpoint."""
        loop, dp = self.loop, self.config.data_parallel
        time_s = loop.now
        while True:
            ends = [o.end_s for o in self.faults.outages if o.at_s <= time_s < o.end_s]
            if not ends:
                break
            time_s = max(ends)
        loop.record("stall", replicas=down, until_s=time_s)
        loop.clock.advance_to(time_s + dp.restart_s)
        self.restarts += 1
        for replica, seconds in self._since_checkpoint:
            self.work.add(replica, "merged", -seconds)
            self.work.add(replica, "rolled_back", seconds)
        lost_steps = self.global_step - self._checkpoint["global_step"]
        self._restore(self._checkpoint)
        loop.record("restart", rolled_back_steps=lost_steps, resume_step=self.global_step)

    def _step(self, participants: list[int]) -> None:
        loop = self.loop
        start = loop.now
        durations = {i: self.timers[i].next_duration_s() for i in participants}
        comm_s = allreduce_s(self.config.data_parallel.allreduce, replicas=len(participants),
                             nbytes=self.model_bytes)
        end = start + max(durations.values()) + comm_s
        failure = min(((o.at_s, o.target) for o in self.faults.outages
                       if o.target in participants and start < o.at_s < end), default=None)
        if failure is not None:
            fail_s, replica = failure
            for i, duration in durations.items():
                self.work.add(i, "crashed", min(duration, fail_s - start))
            self.failures += 1
            loop.clock.advance_to(fail_s)
            loop.record("fail", replica=replica, step=self.global_step)
            return
        batches = [self.streams[i].next_batch() for i in participants]
        batch = _concat(batches)
        self.config.workload.apply_lr(self.optimizer, spent_tokens=self.kept_tokens,
                                      num_learners=self.config.cluster.num_learners)
        loss = inner_step(self.model, self.optimizer, batch, grad_clip=self.config.workload.inner.grad_clip)
        loop.clock.advance_to(end)
        self.global_step += 1
        if self.global_step > self._high_step:
            self._high_step = self.global_step
            self.advances.append(Advance(end, tuple(participants), float(batch.tokens)))
        self.kept_tokens += batch.tokens
        self.tokens_processed += batch.tokens
        sent = allreduce_bytes(replicas=len(participants), nbytes=self.model_bytes)
        self.peak_bytes_per_step = max(self.peak_bytes_per_step, sent)
        for i, duration in durations.items():
            self.work.add(i, "merged", duration)
            self.bytes_per_replica[i] += sent
            if not self.config.data_parallel.elastic:
                self._since_checkpoint.append((i, duration))
        loop.record("step", step=self.global_step, replicas=participants, loss=loss, duration_s=end - start)
        if not self.config.data_parallel.elastic and self.global_step % \
                self.config.data_parallel.checkpoint_every_steps == 0:
            self._checkpoint = self._snapshot()
            loop.record("checkpoint", step=self.global_step)
        while self._eval_marks and self.kept_tokens >= self._eval_marks[0]:
            self._eval_marks.pop(0)
            self._evaluate()

    # ---- checkpoints -----------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        self._since_checkpoint = []
        return {"global_step": self.global_step, "kept_tokens": self.kept_tokens,
                "model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "streams": [s.state_dict() for s in self.streams]}

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        self.global_step = checkpoint["global_step"]
        self.kept_tokens = checkpoint["kept_tokens"]
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
        for stream, state in zip(self.streams, checkpoint["streams"], strict=True):
            stream.load_state_dict(state)
        self._since_checkpoint = []

    # ---- results ---------------------------------------------------------------------------------

    def _evaluate(self) -> None:
        loss = self.evaluator.loss(dict(self.model.named_parameters()))
        self.curve.append(CurvePoint(self.kept_tokens, self.loop.now, loss))
        self.loop.record("eval", tokens=self.kept_tokens, val_loss=loss)

    def _metrics(self, events: EventLog, final_loss: float) -> dict[str, Any]:
        metrics = core_metrics(events, final_loss=final_loss, tokens_processed=self.tokens_processed,
                               tokens_merged=self.kept_tokens)
        metrics.update({
            "bytes_up": sum(self.bytes_per_replica),
            "bytes_down": sum(self.bytes_per_replica),
            "peak_bytes_per_step_up": self.peak_bytes_per_step,
            "peak_bytes_per_step_down": self.peak_bytes_per_step,
            "global_steps": self.global_step,
            "failures": self.failures,
            "restarts": self.restarts,
        })
        return metrics

    def _settings(self) -> dict[str, Any]:
        config = self.config
        return {"workload": config.workload.to_dict(), "cluster": dataclasses.asdict(config.cluster),
                "data_parallel": dataclasses.asdict(config.data_parallel), "seed": config.seed,
                "uptime_bin_s": self.uptime_bin_s,
                "faults": outages_json(self.faults)}
