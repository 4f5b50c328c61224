"""Train a small MLP with ddiloco: any `nn.Module` and any loss, not only language models.

The task is made here: regress the outputs of a fixed random "teacher" network from Gaussian inputs.
Each learner draws its own inputs (a per-shard seed), so learners see different data from one task.
A plain PyTorch loop; the ddiloco lines are marked `# ddiloco`.

    ddiloco run --learners 2 --inner-steps 300 --evaluate -- python examples/mlp.py
    ddiloco export RUN_DIR --out mlp.safetensors
"""

import torch
import torch.nn.functional as F
from torch import nn

import ddiloco

IN_DIM, OUT_DIM = 16, 4
BATCH_SIZE = 64
TEACHER_SEED = 1234  # fixed: the task is the same for every learner and every run


def build_model() -> nn.Module:
    # BatchNorm would train too (its running statistics stay each learner's own; the export and the evaluator
    # average them over the learners: docs/your_model.md), but LayerNorm needs no statistics at all.
    return nn.Sequential(nn.Linear(IN_DIM, 256), nn.GELU(), nn.LayerNorm(256),
                         nn.Linear(256, 256), nn.GELU(), nn.Linear(256, OUT_DIM))


def teacher(x: torch.Tensor) -> torch.Tensor:
    """y = W2 tanh(W1 x): a fixed random network, regenerated from TEACHER_SEED instead of stored."""
    g = torch.Generator().manual_seed(TEACHER_SEED)
    w1 = torch.randn(IN_DIM, 32, generator=g) / IN_DIM ** 0.5
    w2 = torch.randn(32, OUT_DIM, generator=g) / 32 ** 0.5 * 2
    return torch.tanh(x @ w1.to(x.device)) @ w2.to(x.device)


class TeacherData:
    """An endless stream of (x, teacher(x)) batches. The generator's state is the data position, so
    state_dict() lets a restarted learner continue the stream instead of replaying it."""

    def __init__(self, shard: int, seed: int, device: str = "cpu") -> None:
        self.generator = torch.Generator().manual_seed(seed * 1000 + shard)  # one stream per shard
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
    """Mean squared error on 4096 fixed held-out inputs (their own seed, never drawn for training)."""
    x = torch.randn(4096, IN_DIM, generator=torch.Generator().manual_seed(TEACHER_SEED + 1))
    x = x.to(next(model.parameters()).device)
    y = teacher(x)
    mse = F.mse_loss(model(x), y).item()
    return {"val_loss": mse, "val_r2": 1.0 - mse / y.var().item()}  # r2: 0 = predicts the mean, 1 = perfect


def main() -> None:
    env = ddiloco.environment()  # ddiloco
    torch.manual_seed(env.seed)  # every learner builds the same initial model
    model = build_model().to(env.device)
    if env.role == "evaluator":  # ddiloco: the extra copy `ddiloco run --evaluate` starts
        ddiloco.watch(model, evaluate)
        return
    data = TeacherData(shard=env.learner_id, seed=env.seed, device=env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with ddiloco.session(model, optimizer, state={"data": data}) as sync:  # ddiloco
        while not sync.done:
            x, y = data.next_batch()
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=len(x), loss=loss.item())  # ddiloco: samples in this batch
    print(evaluate(model))


if __name__ == "__main__":
    main()
