"""Under Inductor, what Inductor recomputes for free is recomputed, not kept (``planning.fused_free``).

The class: views and zero-FLOP pointwise values made only from values alive anyway (parameters,
buffers), directly or through a chain of such values. Planned for Inductor, a plan keeps none of
them whose backward readers can fuse them (a matmul reader cannot: such a value stays kept);
planned for eager, the plan is unchanged; the unfused peak never rises. End to end (Inductor,
``backend_default``): the step equals torch.compile's bit for bit, dropout on, within its budget.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from remat_pass import solvers
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.examples import GPT, GPTConfig, lm_loss
from remat_pass.planning.budget import Budget
from remat_pass.planning.fused_free import free_values, fuses_into_backward
from remat_pass.planning.pipeline import PlanOptions, as_compiled, plan_problem
from remat_pass.solvers.problem import Problem
from remat_pass.solvers.tags import Tag

from .helpers import fitted_against_torch_compile

CONFIG = GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=2, dropout=0.1)


class _WithLoss(nn.Module):
    """The built-in GPT and its loss in one module: the loss inside the planned step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(tokens), targets)


def _gpt_step() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    return _WithLoss(GPT(CONFIG)), (tokens, torch.roll(tokens, -1, dims=1))


def _keep_all(annotated):
    return plan_problem(annotated.problem, PlanOptions(Budget(fraction=1.0), budget_kind="saved")).plan


def _annotated(module: nn.Module, inputs, compiler: str):
    joint, = capture(module, inputs)
    return annotate(replace(joint, compiler=compiler), free_inputs=False)


def _weight_views(problem: Problem) -> list[str]:
    """Views of views of available values (a weight's transpose): no kernel to recompute."""
    values = problem.values

    def only_views(i: int) -> bool:
        return Tag.VIEW in values[i].tags and all(values[j].available or only_views(j) for j in values[i].inputs)

    return [value.name for value in values if only_views(value.id)]


def test_keep_all_for_inductor_recomputes_the_mask_and_weight_views_and_peaks_no_higher():
    module, inputs = _gpt_step()
    annotated = _annotated(module, inputs, "inductor")
    plan = _keep_all(annotated)
    compiled = as_compiled(annotated, plan)
    values = annotated.problem.values
    moved = plan.kept - compiled.kept
    assert moved and moved <= compiled.recomputed and plan.recomputed <= compiled.recomputed
    assert compiled.fused == compiled.recomputed - plan.recomputed and "fused" in compiled.summary()
    ops = {values[i].op.split(".")[0] for i in moved}
    assert "bitwise_not" in ops, ops  # the causal mask's `not`, recomputed from the mask buffer
    weight_views = set(_weight_views(annotated.problem))
    assert weight_views and not weight_views & {values[i].name for i in compiled.kept}  # transposes of weights
    free = free_values(annotated)
    left = [values[i].name for i in compiled.kept & free if fuses_into_backward(annotated, compiled, i)
            and i not in annotated.problem.forward_outputs]
    assert not left
    assert all(values[i].flops == 0 and values[i].recomputable for i in compiled.recomputed)
    assert solvers.simulate_plan(annotated.problem, compiled).peak_bytes <= solvers.simulate_plan(
        annotated.problem, plan).peak_bytes
    assert compiled.predicted_peak_bytes == solvers.simulate_plan(annotated.problem, compiled).peak_bytes


def test_for_eager_the_plan_is_as_made():
    module, inputs = _gpt_step()
    annotated = _annotated(module, inputs, "eager")
    plan = _keep_all(annotated)
    assert as_compiled(annotated, plan) is plan
    assert any(annotated.problem.values[i].op.startswith("bitwise_not") for i in plan.kept)


class _BufferFed(nn.Module):
    """Two pointwise values of a buffer: ``sin`` read in backward by a matmul (the weight's
    gradient), which Inductor cannot fuse it into; ``cos`` by a multiplication, which it can."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("b", torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.b.sin() @ self.w) * x * self.b.cos()).sum()


def test_a_value_read_by_a_matmul_in_backward_stays_kept():
    module = _BufferFed()
    annotated = _annotated(module, (torch.randn(4, 8, requires_grad=True),), "inductor")
    plan = _keep_all(annotated)
    compiled = as_compiled(annotated, plan)
    values = annotated.problem.values
    kept = {values[i].op.split(".")[0] for i in compiled.kept}
    recomputed = {values[i].op.split(".")[0] for i in compiled.recomputed}
    assert "sin" in kept and "sin" not in recomputed
    assert "cos" in recomputed and "cos" not in kept
    assert {values[i].op.split(".")[0] for i in free_values(annotated)} >= {"sin", "cos"}


@pytest.mark.backend_default
def test_the_inductor_step_keeps_none_of_them_and_equals_torch_compile_within_its_budget():
    """Inductor runs the plan (a loose peak budget: the fit's first candidate); the plan keeps no
    `not` of the mask and no view of a weight, and the step, dropout on, is torch.compile's bit
    for bit, its measured peak within the budget."""
    backend = fitted_against_torch_compile(*_gpt_step(), scale=2.0)
    plan, = backend.plans
    values = plan.problem.values
    kept = {values[i].name for i in plan.kept}
    assert not [values[i].name for i in plan.kept if values[i].op.startswith("bitwise_not")]
    assert not kept & set(_weight_views(plan.problem))
    assert any(values[i].op.startswith("bitwise_not") for i in plan.fused)
