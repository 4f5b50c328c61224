"""The data-parallel baselines of the virtual-time harness: the same model, data and inner step."""

import pytest
import torch

from ddiloco.data import Batch, load_corpus, shard_stream
from ddiloco.sim.cluster import ClusterConfig
from ddiloco.sim.data_parallel import (
    DataParallelConfig,
    DataParallelSim,
    DataParallelSimConfig,
    allreduce_bytes,
    allreduce_s,
)
from ddiloco.sim.faults import FaultPlan
from ddiloco.sim.links import LinkConfig
from ddiloco.sim.workload import seeded_model
from ddiloco.training import apply_inner_lr, inner_step, make_inner_optimizer
from tests.helpers import tiny_sim_workload

torch.set_num_threads(1)

INSTANT = LinkConfig(latency_s=0.0, bandwidth_bps=1e18)
"""An interconnect so fast that a step lasts exactly its compute time (to a few 1e-12 s)."""


def run(*, num=2, steps=10, faults=None, uptime_bin_s=None, **dp):
    config = DataParallelSimConfig(workload=tiny_sim_workload(inner_steps=steps),
                                   cluster=ClusterConfig(num_learners=num),
                                   data_parallel=DataParallelConfig(allreduce=INSTANT, **dp))
    sim = DataParallelSim(config, faults=faults, uptime_bin_s=uptime_bin_s)
    return sim, sim.run()


def test_data_parallel_is_one_model_on_the_replicas_batches_side_by_side():
    sim, result = run(num=3, steps=6)
    workload = sim.config.workload
    model = seeded_model(workload.model, 0)
    optimizer = make_inner_optimizer(model, workload.inner)
    streams = [shard_stream(load_corpus(), workload.data, shard=i, num_shards=3) for i in range(3)]
    for step in range(6):
        batches = [s.next_batch() for s in streams]
        batch = Batch(torch.cat([b.inputs for b in batches]), torch.cat([b.targets for b in batches]),
                      sum(b.tokens for b in batches))
        apply_inner_lr(optimizer, workload.inner, step, 6)  # the cooldown: the last 0.2 x 6 steps decay
        inner_step(model, optimizer, batch, grad_clip=workload.inner.grad_clip)
    for name, param in model.named_parameters():
        assert torch.equal(result.final_params[name], param.detach())
    assert result.metrics["goodput"] == pytest.approx(1.0)
    assert result.metrics["tokens_merged"] == workload.token_budget(3)


def test_ring_allreduce_cost():
    link = LinkConfig(latency_s=0.001, bandwidth_bps=8e6)  # 1 MB/s
    assert allreduce_s(link, replicas=1, nbytes=10**6) == 0
    assert allreduce_s(link, replicas=4, nbytes=10**6) == pytest.approx(1.5 + 6 * 0.001)
    assert allreduce_bytes(replicas=4, nbytes=1000) == 1500


def test_non_elastic_failure_stalls_everyone_and_rolls_back_to_the_checkpoint():
    # 2 replicas, 1 s steps, checkpoint every 4 steps. Replica 1 fails at 5.5 s (during step 6) and is
    # back at 8 s; the job relaunches in 2 s and redoes step 5 from the checkpoint at step 4.
    faults = FaultPlan.of([(1, 5.5, 8.0)])
    _, result = run(faults=faults, checkpoint_every_steps=4, restart_s=2.0, uptime_bin_s=2.0)
    m = result.metrics
    assert m["restarts"] == 1 and m["failures"] == 1
    assert m["virtual_time_s"] == pytest.approx(16.0)  # 5.5 + wait to 8 + 2 + 6 steps
    assert m["goodput"] == pytest.approx(20 / 32)  # 10 kept steps x 2 replicas over 2 x 16 s
    assert m["work_breakdown"]["rolled_back"] == pytest.approx(2 / 32)
    assert m["work_breakdown"]["crashed"] == pytest.approx(1 / 32)
    # The global model advances with steps 1-5 (t = 1..5) and 6-10 (t = 12..16; step 5 again at 11 is not
    # progress): of the 2 s bins [0, 16), those from 0, 2, 4, 12 and 14 hold an advance.
    assert m["uptime"] == pytest.approx(10 / 16)
    assert [a.time_s for a in result.events.advances] == pytest.approx([1, 2, 3, 4, 5, 12, 13, 14, 15, 16])
    assert m["tokens_processed"] == m["tokens_merged"] + 2 * 2 * 16  # step 5 twice, 2 replicas x 2 x 16
    # Checkpoints restore model, optimizer and data cursors: the result equals a run without failures.
    _, clean = run(checkpoint_every_steps=4, restart_s=2.0)
    assert all(torch.equal(clean.final_params[n], t) for n, t in result.final_params.items())


def test_elastic_survivors_continue_and_the_returning_replica_is_readmitted():
    faults = FaultPlan.of([(1, 3.5, 6.0)])
    _, result = run(faults=faults, elastic=True, downscale_s=1.0, upscale_s=1.0, uptime_bin_s=1.0)
    m = result.metrics
    kinds = [e["kind"] for e in result.log]
    assert "downscale" in kinds and "upscale" in kinds and m["restarts"] == 0
    solo = [e for e in result.log if e["kind"] == "step" and e["replicas"] == [0]]
    assert solo  # replica 0 trained alone while 1 was down
    assert m["tokens_merged"] == 2 * 10 * 32  # the budget, exactly
    assert m["goodput"] < 1.0 and m["uptime"] < 1.0
    _, clean = run(elastic=True)
    assert clean.metrics["goodput"] > m["goodput"]


def test_slowest_replica_sets_the_pace():
    config = DataParallelSimConfig(workload=tiny_sim_workload(inner_steps=4),
                                   cluster=ClusterConfig(num_learners=2, slowdowns=(0.0, 1.0)),
                                   data_parallel=DataParallelConfig(allreduce=INSTANT))
    result = DataParallelSim(config).run()
    assert result.metrics["virtual_time_s"] == pytest.approx(8.0)
    assert result.metrics["goodput"] == pytest.approx((4 + 8) / 16)


@pytest.mark.parametrize("field, value", [("checkpoint_every_steps", 0), ("restart_s", -1.0)])
def test_data_parallel_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        DataParallelConfig(**{field: value})
