"""TinyGPT: a small decoder-only transformer, written top to bottom in the manner of nanoGPT.

Owns the model, its config, parameter counting and loss estimation. It knows nothing about
learners, fragments or parallelism: fragments are cut from outside by parameter name, so the names
below are part of the interface:

    token_embedding.weight, position_embedding.weight,
    blocks.{i}.attn_norm.*, blocks.{i}.attn.{qkv,proj}.*, blocks.{i}.mlp_norm.*, blocks.{i}.mlp.{fc,proj}.*,
    final_norm.*, lm_head.weight

The embedding and output weights are NOT tied, so every parameter is a distinct tensor with one name.
Architecture after GPT-2 (Radford et al. 2019) as in nanoGPT (https://github.com/karpathy/nanoGPT):
pre-LayerNorm blocks, causal self-attention, GELU MLP.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.checks import require_int
from ddiloco.data import Batch

INIT_STD = 0.02
"""GPT-2's standard deviation for every linear and embedding weight."""



@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a TinyGPT. The default has 478,720 parameters."""

    vocab_size: int = 256
    """Number of token ids; 256 = one per byte value, matching ``ddiloco.data.VOCAB_SIZE``."""
    context_len: int = 128
    """Longest sequence, in tokens, the model accepts (size of the position embedding)."""
    width: int = 128
    """Residual stream width (embedding dimension C)."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; must divide ``width``."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``width``."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches; 0 <= dropout < 1."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "width", "num_layers", "num_heads", "mlp_ratio"):
            require_int(name, getattr(self, name), minimum=1)
        if self.width % self.num_heads != 0:
            raise ValueError(
                f"width must be divisible by num_heads, got width={self.width}, num_heads={self.num_heads}"
            )
        if (
            not isinstance(self.dropout, int | float)
            or isinstance(self.dropout, bool)
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)  # q, k, v for all heads in one matmul
        self.proj = nn.Linear(config.width, config.width)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        H = self.num_heads
        q, k, v = self.qkv(x_BTC).split(C, dim=2)  # each (B, T, C)
        q_BHTD = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k_BHTD = k.view(B, T, H, C // H).transpose(1, 2)
        v_BHTD = v.view(B, T, H, C // H).transpose(1, 2)
        y_BHTD = F.scaled_dot_product_attention(
            q_BHTD, k_BHTD, v_BHTD, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y_BTC = y_BHTD.transpose(1, 2).contiguous().view(B, T, C)  # re-join the heads
        return self.resid_dropout(self.proj(y_BTC))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, config.mlp_ratio * config.width)
        self.proj = nn.Linear(config.mlp_ratio * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        h_BTF = F.gelu(self.fc(x_BTC))  # (B, T, mlp_ratio * C)
        return self.dropout(self.proj(h_BTF))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.attn_norm(x_BTC))
        return x_BTC + self.mlp(self.mlp_norm(x_BTC))


class TinyGPT(nn.Module):
    """Decoder-only transformer over byte tokens. Initialisation draws from torch's global RNG, so
    ``torch.manual_seed(s)`` before construction makes it deterministic."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.context_len, config.width)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2: every linear and embedding weight ~ N(0, 0.02), biases zero, LayerNorm at identity;
        # the two projections that write into the residual stream per block are scaled down by
        # 1/sqrt(2 * num_layers) so the residual's variance does not grow with depth.
        residual_std = INIT_STD / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids (B, T); with targets, also the mean cross-entropy per token."""
        B, T = idx_BT.shape
        if idx_BT.shape[1] > self.config.context_len:
            raise ValueError(f"sequence length {T} exceeds context_len={self.config.context_len}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTC = self.token_embedding(idx_BT) + self.position_embedding(pos_T)  # (B, T, C) + (T, C)
        x_BTC = self.dropout(x_BTC)
        for block in self.blocks:
            x_BTC = block(x_BTC)
        logits_BTV = self.lm_head(self.final_norm(x_BTC))  # (B, T, V)
        if targets_BT is None:
            return logits_BTV, None
        loss = F.cross_entropy(logits_BTV.reshape(B * T, -1), targets_BT.reshape(B * T))
        return logits_BTV, loss


def build_model(config: ModelConfig | None = None) -> TinyGPT:
    """A freshly initialised TinyGPT; the default config when none is given."""
    return TinyGPT(config if config is not None else ModelConfig())


def count_parameters(model: nn.Module) -> int:
    """Total number of scalar parameters."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def estimate_loss(model: nn.Module, batches: Iterable[Batch]) -> float:
    """Mean cross-entropy per target token over ``batches``, in eval mode (no dropout).

    Batches are weighted by their ``tokens``, so a partial batch counts for what it holds. The
    model's train/eval mode is restored afterwards.
    """
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        loss_sum = 0.0
        tokens = 0
        for batch in batches:
            _, loss = model(batch.inputs.to(device), batch.targets.to(device))
            loss_sum += loss.item() * batch.tokens
            tokens += batch.tokens
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("estimate_loss needs at least one batch with tokens, got none")
    return loss_sum / tokens
