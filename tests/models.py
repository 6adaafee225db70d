"""Small models for the end-to-end tests: each exercises one thing that can go wrong."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from remat_pass.examples import GPT, GPTConfig, lm_loss


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return self.out(x)


class ConvNet(nn.Module):
    """Conv + BatchNorm: running statistics must be updated exactly once per step."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x))) + x
        return self.head(x.mean(dim=(2, 3)))


class TiedWeights(nn.Module):
    """One Linear used twice and an embedding tied to the output projection."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.shared = nn.Linear(width, width)
        self.unembed = nn.Linear(width, vocab, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = F.gelu(self.shared(x))
        x = F.gelu(self.shared(x)) + x
        return self.unembed(x)


class InPlace(nn.Module):
    """In-place activations and accumulations, which functionalization must untangle."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.mul_(0.5)
        h += x
        h = self.act(h)
        y = self.fc2(h)
        y.sigmoid_()
        return y * h


class GPTWithLoss(nn.Module):
    """The loss inside the module: the whole step is one captured graph."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, tokens, targets):
        return lm_loss(self.gpt(tokens), targets)


def tiny_gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=2, dropout=0.1)


def make_case(name: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], "callable"]:
    """A seeded model, its inputs and a loss function of (output, *inputs)."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(), (torch.randn(8, 32),), lambda out, x: out.square().mean()
    if name == "cnn":
        return ConvNet(), (torch.randn(4, 3, 8, 8),), lambda out, x: out.square().mean()
    if name == "gpt":
        config = tiny_gpt_config()
        targets = torch.randint(0, config.vocab_size, (2, config.seq_len))
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
        loss = lambda out, tokens: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
        return GPT(config), (tokens,), loss
    if name == "tied":
        return TiedWeights(), (torch.randint(0, 32, (4, 6)),), lambda out, t: out.logsumexp(-1).mean()
    if name == "inplace":
        return InPlace(), (torch.randn(6, 24),), lambda out, x: out.sum()
    raise KeyError(name)


CASES = ("mlp", "cnn", "gpt", "tied", "inplace")
