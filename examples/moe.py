"""Train a tiny mixture-of-experts language model (`transformers` Mixtral, 452 k parameters) with ddiloco.

Shows a model whose loss is more than cross-entropy: 8 experts per layer, 2 active per token, and a
router load-balancing loss added to the language-model loss. Built from a config (no download),
trained on the embedded Shakespeare corpus as bytes. The ddiloco lines are marked `# ddiloco`. Needs
`pip install "transformers==5.23.0"`.

    ddiloco run --learners 2 --inner-steps 300 --evaluate -- python examples/moe.py
    ddiloco export RUN_DIR --out moe.safetensors
"""

import functools

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

import ddiloco
from ddiloco.data import load_corpus

CONTEXT_LEN = 64
BATCH_SIZE = 8
VAL_FRACTION = 0.05  # the last 5% of the corpus is held out for evaluate()
AUX_LOSS_WEIGHT = 0.01  # weight of the router's load-balancing loss


def build_model() -> MixtralForCausalLM:
    # output_router_logits=True makes forward() return `aux_loss`, which keeps experts evenly used.
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=CONTEXT_LEN, output_router_logits=True, use_cache=False,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return MixtralForCausalLM(config)


def byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class ByteWindows:
    """Random windows of CONTEXT_LEN + 1 bytes from this learner's contiguous shard of the training bytes;
    the generator's state is the data position, saved and restored with the learner's checkpoint."""

    def __init__(self, shard: int, num_shards: int, seed: int, device: str = "cpu") -> None:
        corpus = load_corpus()
        train = corpus[: int(len(corpus) * (1 - VAL_FRACTION))]
        self.tokens = byte_tensor(train[len(train) * shard // num_shards: len(train) * (shard + 1) // num_shards])
        self.generator = torch.Generator().manual_seed(seed * 1000 + shard)
        self.device = device

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - CONTEXT_LEN, (BATCH_SIZE,), generator=self.generator)
        windows = torch.stack([self.tokens[s: s + CONTEXT_LEN + 1] for s in starts.tolist()]).to(self.device)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def losses(model: MixtralForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, load-balancing loss). Train on their weighted sum; report the cross-entropy."""
    out = model(input_ids=inputs)
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()), out.aux_loss


@functools.cache
def held_out() -> torch.Tensor:
    corpus = load_corpus()
    tokens = byte_tensor(corpus[int(len(corpus) * (1 - VAL_FRACTION)):])
    starts = torch.linspace(0, len(tokens) - CONTEXT_LEN - 1, 16 * 32).long().tolist()
    return torch.stack([tokens[s: s + CONTEXT_LEN + 1] for s in starts]).view(16, 32, -1)  # 16 fixed batches


@torch.no_grad()
def evaluate(model: MixtralForCausalLM) -> dict[str, float]:
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    pairs = [losses(model, w[:, :-1].to(device), w[:, 1:].to(device)) for w in held_out()]
    model.train(was_training)
    # val_aux_loss is about 2 (the top-k) while the experts are evenly used, higher when they are not.
    return {"val_loss": sum(ce.item() for ce, _ in pairs) / len(pairs),
            "val_aux_loss": sum(aux.item() for _, aux in pairs) / len(pairs)}


def main() -> None:
    env = ddiloco.environment()  # ddiloco
    torch.manual_seed(env.seed)  # every learner builds the same initial model
    model = build_model().to(env.device)
    if env.role == "evaluator":  # ddiloco: the extra copy `ddiloco run --evaluate` starts
        ddiloco.watch(model, evaluate)
        return
    data = ByteWindows(shard=env.learner_id, num_shards=env.num_learners, seed=env.seed, device=env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with ddiloco.session(model, optimizer, state={"data": data}) as sync:  # ddiloco
        while not sync.done:
            inputs, targets = data.next_batch()
            ce, aux = losses(model, inputs, targets)
            optimizer.zero_grad()
            (ce + AUX_LOSS_WEIGHT * aux).backward()
            optimizer.step()
            sync.step(tokens=inputs.numel(), loss=ce.item())  # ddiloco
    print(evaluate(model))


if __name__ == "__main__":
    main()
