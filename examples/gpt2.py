"""Train a Hugging Face `transformers` GPT-2 (tiny config, 438 k parameters) with ddiloco.

Shows that ddiloco needs nothing from the model: a stock `GPT2LMHeadModel` built from a config (no
weights downloaded), trained on the embedded Shakespeare corpus as bytes (vocabulary 256). It is a
plain PyTorch loop; the ddiloco lines are marked `# ddiloco`. Needs `pip install "transformers==5.23.0"`.

    ddiloco run --learners 2 --inner-steps 300 --evaluate -- python examples/gpt2.py
    ddiloco export RUN_DIR --out gpt2.safetensors   # then model.load_state_dict(safetensors.torch.load_file(...))
"""

import functools

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import ddiloco
from ddiloco.data import load_corpus

CONTEXT_LEN = 64
BATCH_SIZE = 8
VAL_FRACTION = 0.05  # the last 5% of the corpus is held out for evaluate()


def build_model() -> GPT2LMHeadModel:
    # Dropout off and exact GELU: on one CPU thread that is ~30 ms a step instead of ~45 ms.
    # bos/eos default to GPT-2's token 50256, outside a byte vocabulary, so they are unset.
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT_LEN, n_embd=128, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu",
                        use_cache=False, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)  # lm_head.weight is tied to transformer.wte.weight


class ByteWindows:
    """Random windows of CONTEXT_LEN + 1 bytes from one contiguous shard of the training bytes. The
    generator's state is the whole data position, so state_dict() lets a restarted learner resume."""

    def __init__(self, shard: int, num_shards: int, seed: int, device: str = "cpu") -> None:
        corpus = load_corpus()
        train = corpus[: int(len(corpus) * (1 - VAL_FRACTION))]
        part = train[len(train) * shard // num_shards: len(train) * (shard + 1) // num_shards]
        self.tokens = torch.frombuffer(bytearray(part), dtype=torch.uint8).long()
        self.generator = torch.Generator().manual_seed(seed * 1000 + shard)
        self.device = device

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - CONTEXT_LEN, (BATCH_SIZE,), generator=self.generator)
        windows = torch.stack([self.tokens[s: s + CONTEXT_LEN + 1] for s in starts.tolist()]).to(self.device)
        return windows[:, :-1], windows[:, 1:]  # inputs, next-byte targets

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def lm_loss(model: GPT2LMHeadModel, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Our targets are already shifted, so take the logits and skip transformers' `labels=` path.
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@functools.cache
def held_out() -> torch.Tensor:
    """16 x 32 fixed, evenly spaced windows of the held-out bytes: the same every call."""
    corpus = load_corpus()
    tokens = torch.frombuffer(bytearray(corpus[int(len(corpus) * (1 - VAL_FRACTION)):]), dtype=torch.uint8).long()
    starts = torch.linspace(0, len(tokens) - CONTEXT_LEN - 1, 16 * 32).long().tolist()
    return torch.stack([tokens[s: s + CONTEXT_LEN + 1] for s in starts]).view(16, 32, -1)


@torch.no_grad()
def evaluate(model: GPT2LMHeadModel) -> dict[str, float]:
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    losses = [lm_loss(model, w[:, :-1].to(device), w[:, 1:].to(device)).item() for w in held_out()]
    model.train(was_training)
    return {"val_loss": sum(losses) / len(losses)}


def main() -> None:
    env = ddiloco.environment()  # ddiloco: learner id, number of learners, device, role, seed
    torch.manual_seed(env.seed)  # every learner builds the same initial model
    model = build_model().to(env.device)
    if env.role == "evaluator":  # ddiloco: `ddiloco run --evaluate` starts one copy in this role
        ddiloco.watch(model, evaluate)
        return
    data = ByteWindows(shard=env.learner_id, num_shards=env.num_learners, seed=env.seed, device=env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with ddiloco.session(model, optimizer, state={"data": data}) as sync:  # ddiloco
        while not sync.done:
            inputs, targets = data.next_batch()
            loss = lm_loss(model, inputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(tokens=inputs.numel(), loss=loss.item())  # ddiloco
    print(evaluate(model))


if __name__ == "__main__":
    main()
