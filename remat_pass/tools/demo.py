"""The built-in demo: one training step of a GPT-style model, eager and optimized, side by side.

``remat-pass demo`` runs it. It measures (not predicts) the bytes autograd saves for backward in
both runs, checks that loss and gradients agree, and prints the plan.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from remat_pass.solvers.problem import Plan, format_bytes

from ..runtime.api import optimize
from ..examples import GPTConfig, gpt_example, lm_loss
from ..runtime.measure import saved_activation_bytes


@dataclass(frozen=True)
class DemoResult:
    plan: Plan
    eager_saved_bytes: int
    optimized_saved_bytes: int
    loss_difference: float
    max_gradient_difference: float
    plan_seconds: float

    def report(self) -> str:
        ratio = self.optimized_saved_bytes / self.eager_saved_bytes if self.eager_saved_bytes else 0.0
        return "\n".join(
            [
                str(self.plan),
                "",
                f"saved for backward, measured: eager {format_bytes(self.eager_saved_bytes)}, "
                f"optimized {format_bytes(self.optimized_saved_bytes)} ({ratio:.1%} of eager)",
                f"predicted recompute: {self.plan.recompute_flops / 1e6:.1f} MFLOP "
                f"(planning took {self.plan_seconds:.1f}s, capture included)",
                f"loss difference {self.loss_difference:.2e}, max gradient difference "
                f"{self.max_gradient_difference:.2e} (same dropout masks as eager)",
            ]
        )


def _step(model: torch.nn.Module, call, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    torch.manual_seed(1234)
    exclude = [tokens, *model.parameters(), *model.buffers()]
    logits, saved = saved_activation_bytes(lambda: call(tokens), exclude=exclude)
    loss = lm_loss(logits, targets)
    loss.backward()
    return loss.detach(), saved


def run_demo(budget: object = 0.3, config: GPTConfig = GPTConfig(), batch: int = 4) -> DemoResult:
    """One step eager, one step through ``optimize(model, budget)``; same weights and seed."""
    model, tokens, targets = gpt_example(config, batch=batch)
    eager_model = copy.deepcopy(model)
    eager_loss, eager_saved = _step(eager_model, eager_model, tokens, targets)

    started = time.perf_counter()
    optimized = optimize(model, budget=budget, example_inputs=(tokens,))
    plan_seconds = time.perf_counter() - started
    loss, saved = _step(model, optimized, tokens, targets)

    gradient_difference = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), eager_model.parameters())
    )
    assert optimized.plan is not None
    return DemoResult(
        plan=optimized.plan,
        eager_saved_bytes=eager_saved,
        optimized_saved_bytes=saved,
        loss_difference=abs(loss.item() - eager_loss.item()),
        max_gradient_difference=gradient_difference,
        plan_seconds=plan_seconds,
    )
