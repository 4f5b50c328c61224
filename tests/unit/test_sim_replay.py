"""Determinism of the virtual-time harness: same seed and fault plan, bit-for-bit the same run."""

import json

import torch

from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.sim.cluster import ClusterConfig
from ddiloco.sim.data_parallel import DataParallelConfig, DataParallelSim, DataParallelSimConfig
from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig
from ddiloco.sim.faults import draw_fault_plan, harness_failures
from ddiloco.sim.replay import compare, rebuild, replay
from tests.helpers import tiny_sim_workload

torch.set_num_threads(1)

CLUSTER = ClusterConfig(num_learners=3, slowdowns=(0.0, 0.1, 0.3), jitter=0.1)
FAULTS = draw_fault_plan(harness_failures(mtbi_s=15.0, recovery_scale_s=3.0), num_learners=3, horizon_s=60.0, seed=4)


def decoupled(seed=0, faults=FAULTS):
    config = DecoupledSimConfig(workload=tiny_sim_workload(inner_steps=24), cluster=CLUSTER,
                                diloco=DilocoConfig(num_fragments=4, sync_every=8), quorum=QuorumConfig(), seed=seed)
    return DecoupledSim(config, faults=faults).run()


def test_same_seed_and_fault_plan_give_bitwise_identical_parameters_metrics_and_log():
    assert FAULTS.outages  # the plan really injects failures
    first, second = decoupled(), decoupled()
    report = compare(first, second)
    assert report.ok, report
    assert report.log_equal and report.params_equal and report.metrics_equal
    assert report.rounds_reproduce_params  # the syncer's round-log replay gives the same global model
    assert any(e["kind"] == "fail" for e in first.log)


def test_replay_rebuilds_the_run_from_its_json_settings():
    result = decoupled()
    result.settings = json.loads(json.dumps(result.settings))  # as written into the run directory
    assert replay(result).ok


def test_a_different_seed_gives_a_different_run():
    report = compare(decoupled(seed=0), decoupled(seed=1))
    assert not report.log_equal and not report.params_equal


def test_data_parallel_runs_replay_too():
    config = DataParallelSimConfig(workload=tiny_sim_workload(inner_steps=12), cluster=CLUSTER,
                                   data_parallel=DataParallelConfig(checkpoint_every_steps=3, restart_s=1.0))
    result = DataParallelSim(config, faults=FAULTS).run()
    assert result.metrics["restarts"] >= 1
    report = replay(result)
    assert report.ok and report.rounds_reproduce_params is None
    assert isinstance(rebuild(result), DataParallelSim)
