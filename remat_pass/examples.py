"""Built-in example models, built from configs with random init (nothing is downloaded).

The GPT-style decoder is the demo's model and the reference model of the tests: attention,
LayerNorm, GELU, dropout, tied embedding/unembedding weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT-2-style decoder. Defaults are small enough for a CPU demo."""

    vocab_size: int = 512
    seq_len: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    dropout: float = 0.1
    tie_weights: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head attention written out (no SDPA) so that scores and softmax are graph values."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.seq_len, config.seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        q, k, v = self.qkv(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, hidden)
        return self.resid_dropout(self.proj(context))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.proj = nn.Linear(4 * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_example(
    config: GPTConfig = GPTConfig(), batch: int = 4, seed: int = 0
) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """A seeded GPT, a batch of token ids and next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)
    return model, tokens, targets


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
