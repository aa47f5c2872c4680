"""What the demo trains: a small GPT-like model, its synthetic data and its learning-rate schedule.

All three are pure functions of their arguments (the model of the seed set
before it is built, the data of ``(seed, step)``, the learning rate of the
step), so a run resumed from a checkpoint, on any number of processes,
sees exactly what the uninterrupted run saw.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class ModelConfig:
    vocab: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a head; ``forward`` returns the loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of ``step``, a function of (seed, step) only.

    Each row is an arithmetic progression modulo ``vocab`` (random start and
    stride) with 10% of the tokens replaced by noise: learnable, so the loss
    curve goes down, and cheap to regenerate on any number of processes.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919) % (1 << 62))
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, vocab, (batch, seq_len + 1), generator=g), seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lr_at(step: int, peak_lr: float, warmup: int, horizon: int) -> float:
    """Linear warmup to ``peak_lr`` over ``warmup`` steps, then cosine decay to a tenth of it at
    ``horizon``; a pure function of the step, so there is no scheduler state to checkpoint."""
    if step <= warmup:
        return peak_lr * step / warmup
    frac = (step - warmup) / max(1, horizon - warmup)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))
