"""Replaying a simulated run: rebuild it from its recorded settings, run it again, compare bit for bit.

Owns the determinism contract of the harness. A `SimResult` carries its settings (every config, the
seed and the fault plan, JSON-ready), its event log and, for Decoupled DiLoCo, its round log.
`replay(result)` rebuilds the simulation from the settings alone, runs it, and reports:

- whether the two event logs are equal, entry by entry (and the first entry where they differ),
- whether the final global parameters are bitwise equal,
- whether the metrics are equal,
- for Decoupled DiLoCo, whether `ddiloco.syncer.replay_rounds` of the committed rounds reproduces the
  final global parameters bit for bit (the syncer's own round-log replay).

Same seed and same fault plan must give a report with every check true (`tests/unit/test_sim_replay.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco.config import DilocoConfig, LearnerConfig, QuorumConfig
from ddiloco.data import DataConfig
from ddiloco.model import ModelConfig
from ddiloco.sim.accounting import SimResult
from ddiloco.sim.cluster import ClusterConfig
from ddiloco.sim.data_parallel import DataParallelConfig, DataParallelSim, DataParallelSimConfig
from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig
from ddiloco.sim.faults import FaultPlan
from ddiloco.sim.links import LinkConfig
from ddiloco.sim.workload import WorkloadConfig, seeded_model
from ddiloco.syncer import replay_rounds
from ddiloco.training import InnerConfig


@dataclass(frozen=True)
class ReplayReport:
    log_equal: bool
    first_difference: int | None
    """Index of the first event-log entry that differs (None when the logs are equal)."""
    params_equal: bool
    metrics_equal: bool
    rounds_reproduce_params: bool | None
    """replay_rounds(round log) == final global parameters; None for data-parallel (no rounds)."""

    @property
    def ok(self) -> bool:
        return (self.log_equal and self.params_equal and self.metrics_equal
                and self.rounds_reproduce_params is not False)


def _workload(data: Mapping[str, Any]) -> WorkloadConfig:
    return WorkloadConfig(model=ModelConfig(**data["model"]), data=DataConfig(**data["data"]),
                          inner=InnerConfig(**data["inner"]),
                          **{k: v for k, v in data.items() if k not in ("model", "data", "inner")})


def _cluster(data: Mapping[str, Any]) -> ClusterConfig:
    return ClusterConfig(uplink=LinkConfig(**data["uplink"]), downlink=LinkConfig(**data["downlink"]),
                         slowdowns=tuple(data["slowdowns"]),
                         **{k: v for k, v in data.items() if k not in ("uplink", "downlink", "slowdowns")})


def _faults(data: Mapping[str, Any] | list[Mapping[str, Any]]) -> FaultPlan:
    """The plan of a result's settings (results written before the plan type was shared list outages)."""
    if isinstance(data, list):
        return FaultPlan.of((o["learner"], o["start_s"], o["end_s"]) for o in data)
    return FaultPlan.from_json(data)


def rebuild(result: SimResult) -> DecoupledSim | DataParallelSim:
    """A fresh, not yet run simulation with exactly the settings `result` was produced with."""
    settings = result.settings
    faults = _faults(settings["faults"])
    if "diloco" in settings:
        config = DecoupledSimConfig(workload=_workload(settings["workload"]), cluster=_cluster(settings["cluster"]),
                                    diloco=DilocoConfig(**settings["diloco"]),
                                    quorum=QuorumConfig(**settings["quorum"]),
                                    learner=LearnerConfig(**settings["learner"]), seed=settings["seed"])
        return DecoupledSim(config, faults=faults, name=result.system)
    dp = dict(settings["data_parallel"])
    dp["allreduce"] = LinkConfig(**dp["allreduce"])
    config = DataParallelSimConfig(workload=_workload(settings["workload"]), cluster=_cluster(settings["cluster"]),
                                   data_parallel=DataParallelConfig(**dp), seed=settings["seed"])
    return DataParallelSim(config, faults=faults, name=result.system, uptime_bin_s=settings.get("uptime_bin_s"))


def params_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def rounds_reproduce(result: SimResult) -> bool:
    """The syncer's round-log replay gives the run's final global parameters bit for bit."""
    settings = result.settings
    config = DilocoConfig(**settings["diloco"])
    initial = {n: p.detach() for n, p in seeded_model(ModelConfig(**settings["workload"]["model"]),
                                                      settings["seed"]).named_parameters()}
    return params_equal(replay_rounds(config, initial, result.round_log), result.final_params)


def compare(a: SimResult, b: SimResult) -> ReplayReport:
    first = next((i for i, (x, y) in enumerate(zip(a.log, b.log, strict=False)) if x != y), None)
    if first is None and len(a.log) != len(b.log):
        first = min(len(a.log), len(b.log))
    decoupled = "diloco" in a.settings
    return ReplayReport(log_equal=first is None, first_difference=first,
                        params_equal=params_equal(a.final_params, b.final_params),
                        metrics_equal=a.metrics == b.metrics,
                        rounds_reproduce_params=rounds_reproduce(a) if decoupled else None)


def replay(result: SimResult) -> ReplayReport:
    """Run the simulation again from `result.settings` and compare it with `result`."""
    return compare(result, rebuild(result).run())
