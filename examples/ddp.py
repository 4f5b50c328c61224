"""A learner of several ranks: a torchrun script (DDP, or FSDP2 with --fsdp) that trains with ddiloco.

Written the way a torchrun user writes one: `init_process_group`, wrap the model, train. Each learner of
the run is one such job: its ranks split every batch (DDP averages their gradients), rank 0 talks to the
syncer, and the others follow it. The ddiloco lines are marked `# ddiloco`.

    ddiloco run --learners 2 --nproc-per-learner 2 --inner-steps 300 -- python examples/ddp.py
    ddiloco run --learners 2 --nproc-per-learner 2 --inner-steps 300 -- python examples/ddp.py --fsdp
    torchrun --nproc-per-node 2 examples/ddp.py      # one learner by hand (DDILOCO_SYNCER=HOST:PORT ...)

The task is examples/mlp.py's: regress a fixed random teacher network from Gaussian inputs; every rank of
every learner draws its own inputs.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddiloco

IN_DIM, OUT_DIM = 16, 4
BATCH_SIZE = 32
"""Per rank: a learner of N ranks trains on N x BATCH_SIZE samples per inner step."""
TEACHER_SEED = 1234  # fixed: the task is the same for every learner and every run


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN_DIM, 128), nn.GELU(), nn.LayerNorm(128),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, OUT_DIM))


def teacher(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(TEACHER_SEED)
    w1 = torch.randn(IN_DIM, 32, generator=g) / IN_DIM ** 0.5
    w2 = torch.randn(32, OUT_DIM, generator=g) / 32 ** 0.5 * 2
    return torch.tanh(x @ w1.to(x.device)) @ w2.to(x.device)


class TeacherData:
    """An endless stream of (x, teacher(x)) batches, one stream per shard; state_dict() is its position."""

    def __init__(self, shard: int, seed: int, device: str = "cpu") -> None:
        self.generator = torch.Generator().manual_seed(seed * 1000 + shard)
        self.device = device

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH_SIZE, IN_DIM, generator=self.generator).to(self.device)
        return x, teacher(x)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


@torch.no_grad()
def evaluate(model: nn.Module) -> dict[str, float]:
    x = torch.randn(4096, IN_DIM, generator=torch.Generator().manual_seed(TEACHER_SEED + 1))
    x = x.to(next(model.parameters()).device)
    return {"val_loss": F.mse_loss(model(x), teacher(x)).item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP2 instead of DDP")
    args = parser.parse_args()
    env = ddiloco.environment()  # ddiloco
    torch.set_num_threads(env.threads or 1)
    torch.manual_seed(env.seed)  # every learner (and rank) builds the same initial model
    model = build_model().to(env.device)
    if env.role == "evaluator":  # ddiloco: one process, the global model
        ddiloco.watch(model, evaluate)
        return
    dist.init_process_group("nccl" if env.device.startswith("cuda") else "gloo")  # torchrun's RANK, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        trained = model
    else:
        trained = DistributedDataParallel(model)
    data = TeacherData(shard=env.learner_id * world + rank, seed=env.seed, device=env.device)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=2e-3)
    with ddiloco.session(trained, optimizer, state={"data": data}) as sync:  # ddiloco: rank 0 talks to the syncer
        while not sync.done:
            x, y = data.next_batch()
            loss = F.mse_loss(trained(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=len(x), loss=loss.item())  # ddiloco: this rank's samples (the ranks' are summed)
    print(f"learner {env.learner_id} rank {rank} final {evaluate(trained)}", flush=True)  # equal on every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
