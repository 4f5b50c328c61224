"""The downlink codec (issue 12 item 3): bytes per round and final loss, fp32 vs int8 (vs int4) downlink.
Prints figures; run by hand, not a timed test.

    .venv/bin/python benchmarks/bench_downlink.py            # the compression experiment's scale (~2 min a run)
    .venv/bin/python benchmarks/bench_downlink.py --quick    # its --quick scale (seconds)

Each run is the `compression` experiment's Decoupled DiLoCo system (`ddiloco.sim.experiments`: M = 4,
int4 uplink, K = 1 + adaptive grace, same seed, data and initialisation), once per downlink codec. Per
committed round it reports the syncer's payload bytes received (updates) and sent (the round's broadcast
to every live learner), joins excluded: the Welcomes are float32 whatever the codec.
"""

from __future__ import annotations

import argparse

import torch

from ddiloco.config import LearnerConfig
from ddiloco.sim.decoupled import DecoupledSim, DecoupledSimConfig
from ddiloco.sim.experiments import _k1_grace, default_scale, quick_scale

EXPERIMENT = "compression"


def run(downlink_codec: str, *, quick: bool, seed: int) -> dict[str, float]:
    scale = quick_scale() if quick else default_scale()
    config = DecoupledSimConfig(workload=scale.workload(EXPERIMENT), cluster=scale.cluster(),
                                diloco=scale.diloco(codec="int4", downlink_codec=downlink_codec),
                                quorum=_k1_grace(), learner=LearnerConfig(), seed=seed)
    sim = DecoupledSim(config, name=f"down-{downlink_codec}")
    result = sim.run()
    syncer = sim.syncer
    rounds = syncer.rounds_committed
    welcomes = sum(info.joins for info in syncer.learners.values())
    model_bytes = 4 * sum(t.numel() for t in syncer.global_params().values())
    sent = syncer.bytes_sent - welcomes * model_bytes  # joins carry the whole model in float32
    return {"rounds": rounds, "received_per_round": syncer.bytes_received / rounds, "sent_per_round": sent / rounds,
            "final_val_loss": result.metrics["final_val_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the experiments' --quick scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codecs", nargs="+", default=["fp32", "int8", "int4"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'downlink':>8} {'rounds':>6} {'received/round':>15} {'sent/round':>12} {'sent/received':>13} "
          f"{'final_val_loss':>14}")
    for codec in args.codecs:
        m = run(codec, quick=args.quick, seed=args.seed)
        print(f"{codec:>8} {m['rounds']:>6d} {m['received_per_round']:>15,.0f} {m['sent_per_round']:>12,.0f} "
              f"{m['sent_per_round'] / m['received_per_round']:>13.2f} {m['final_val_loss']:>14.4f}", flush=True)


if __name__ == "__main__":
    main()
