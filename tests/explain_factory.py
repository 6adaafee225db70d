"""Factories for ``remat-pass explain`` tests: a 2-block MLP whose bytes are small round numbers.

x (4, 8) fp32 -> 2 x [x + fc2(tanh(fc1(x)))] with fc1: 8->16, fc2: 16->8, no biases -> head: 8->1.
Per block: fc1's output and tanh's are 4*16*4 = 256 bytes, fc2's output and the residual sum
4*8*4 = 128 bytes. Backward reads each tanh output and each residual sum: keep-all is
2 * (256 + 128) = 768 bytes.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH, WIDTH, HIDDEN = 4, 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TwoBlockMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def factory():
    """(model, example_inputs): the shape ``remat-pass explain`` expects."""
    torch.manual_seed(0)
    return TwoBlockMLP(), (torch.randn(BATCH, WIDTH),)


def factory_with_loss():
    """(model, one tensor, loss_fn): a single tensor is accepted as the inputs."""
    torch.manual_seed(0)
    return TwoBlockMLP(), torch.randn(BATCH, WIDTH), lambda out, x: out.square().mean()


class DropoutMLP(nn.Module):
    """fc1 -> dropout -> tanh -> fc2: the dropout mask (4*16 bools = 64 bytes) can never be recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(HIDDEN, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.drop(self.fc1(x))))


def factory_dropout():
    torch.manual_seed(0)
    return DropoutMLP(), (torch.randn(BATCH, WIDTH),)


def not_a_model():
    return "model", (torch.randn(BATCH, WIDTH),)


def wrong_arity():
    return (TwoBlockMLP(),)


class KeywordMLP(nn.Module):
    """forward(x, scale=None): called with keyword inputs, like a Hugging Face model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TwoBlockMLP()

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.body(x if scale is None else x * scale)


def factory_keywords():
    """(model, a dict of keyword inputs): a Hugging Face-style batch."""
    torch.manual_seed(0)
    return KeywordMLP(), {"x": torch.randn(BATCH, WIDTH), "scale": torch.full((1,), 2.0)}


class TinyLanguageModel(nn.Module):
    """Embedding, a block, a linear head over a 512-token vocabulary: 64 tokens' logits (128 KiB in
    fp32) dwarf the block's activations, the loss a language model's cross-entropy."""

    def __init__(self, vocab: int = 512, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.Tanh(),
                                   nn.Linear(4 * width, width, bias=False))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def factory_language_model():
    """(model, tokens, loss_fn): next-token cross-entropy over the logits."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (2, 32))
    return TinyLanguageModel(), (tokens,), lambda logits, t: nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                                         t.flatten())
