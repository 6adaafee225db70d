"""Whether the registered backend's step is bit-equal to plain torch.compile's (both on Inductor).

A linear head with cross-entropy (the smallest case that differs), then the nine families of
``benchmarks.hf_families.MORE_FAMILIES`` as ``tests/test_more_families.py`` builds them (2 layers, h32,
dropout 0.1, the same seed before each step), one thread. Per case: the loss equal or not, and the
largest gradient difference relative to the gradient's largest entry. Run from the repository root:

    PYTHONPATH=. python benchmarks/results/backend_vs_torch_compile/bit_equality.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.hf_families import MORE_FAMILIES
from benchmarks.models import LossOf

VOCAB, SEQ, BATCH = 64, 16, 2  # tests/zoo_models.py's vocabulary, tests/test_more_families.py's sizes


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 5)
        self.register_buffer("targets", torch.randint(0, 5, (8,)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), self.targets)


def compare(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    reference = copy.deepcopy(model)
    losses = []
    for module, backend in ((reference, "inductor"), (model, "remat")):
        torch.manual_seed(7)
        loss = torch.compile(module, backend=backend)(*inputs)
        loss.backward()
        losses.append(loss.detach())
        torch._dynamo.reset()
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    equal = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    return (f"loss {'equal' if torch.equal(*losses) else 'differs'}, gradients "
            f"{'bit-equal' if equal else f'differ by {worst:.2e} (relative)'}")


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("linear head + cross-entropy:", compare(Head(), (torch.randn(8, 32),)), flush=True)
    for name, build in MORE_FAMILIES.items():
        torch.manual_seed(0)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        model = LossOf(build(2, 32, SEQ, VOCAB, 4, dropout=0.1), torch.randint(0, VOCAB, (BATCH, SEQ))).train()
        print(f"{name}:", compare(model, (tokens,)), flush=True)


if __name__ == "__main__":
    main()
