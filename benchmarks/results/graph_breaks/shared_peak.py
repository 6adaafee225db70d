"""A peak budget over a step split at graph breaks: the step's measured activation peak against it.

    PYTHONPATH=. python benchmarks/results/graph_breaks/shared_peak.py [--inner eager|inductor] > out.txt

Two MLP stacks (2 pieces) and three (3 pieces), each stage 3 residual MLP blocks, a data-dependent
``if`` between stages (a graph break outside any loop), the loss inside the forward, CPU fp32.
``optimize(model, budget=f * eager_peak, budget_kind="peak", fullgraph=False)``; the peak is the
allocator's over forward and backward (``measure.peak_activation_bytes``, the parameter gradients left
out), of the second call (the first plans). Each row: the budget, the measured peak and its ratio to the
budget, and per piece its plan's budget, predicted peak and kept bytes; or the refusal's first words.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import remat_pass
from remat_pass.runtime.measure import peak_activation_bytes


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class Stages(nn.Module):
    def __init__(self, stages: int, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(_mlp(width) for _ in range(depth)) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._stage(0, x)
        if x.sum() > 0:  # a graph break between stages, outside any loop
            x = x * 1.5
        x = self._stage(1, x)
        if len(self.stages) > 2:
            if x.sum() > 0:
                x = x * 1.5
            x = self._stage(2, x)
        return x.square().mean()

    def _stage(self, index: int, x: torch.Tensor) -> torch.Tensor:
        for block in self.stages[index]:
            x = x + block(x)
        return x


def step_peak(call, model: nn.Module, x: torch.Tensor) -> int:
    _, peak = peak_activation_bytes(lambda: call(x).backward(), survivors=lambda: [p.grad for p in model.parameters()])
    for parameter in model.parameters():
        parameter.grad = None
    return peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner", default="eager")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"torch {torch.__version__}, inner={args.inner}")
    for stages in (2, 3):
        torch.manual_seed(0)
        model, x = Stages(stages), torch.randn(512, 128)
        eager = step_peak(model, model, x)
        for fraction in (0.7, 0.6, 0.5, 0.4, 0.3):
            budget = int(fraction * eager)
            torch._dynamo.reset()  # each row compiles the same code again: keep under dynamo's recompile limit
            optimized = remat_pass.optimize(model, budget=budget, budget_kind="peak", fullgraph=False, inner=args.inner,
                                            plan_cache=False)
            try:
                step_peak(optimized, model, x)
            except remat_pass.BudgetInfeasibleError as error:
                print(f"{stages} pieces, {fraction}: budget {budget}: refused: {str(error)[:160]}")
                continue
            peak = step_peak(optimized, model, x)
            pieces = [(p.budget_bytes, p.predicted_peak_bytes, p.kept_bytes) for p in optimized.pieces]
            print(f"{stages} pieces, {fraction}: eager {eager}, budget {budget}: measured {peak} ({peak / budget:.3f} "
                  f"of it); pieces (budget, predicted peak, kept): {pieces}")


if __name__ == "__main__":
    main()
