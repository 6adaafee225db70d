"""Shared test helpers: one training step, run eagerly or through remat_pass, compared exactly."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import remat_pass
from remat_pass import BudgetInfeasibleError
from remat_pass.runtime.measure import saved_activation_bytes


@dataclass
class StepResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    saved_bytes: int


def run_step(
    model: nn.Module,
    call: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., torch.Tensor],
    seed: int = 1234,
) -> StepResult:
    """Forward under a fixed seed (same dropout masks), measure saved bytes, backward."""
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    exclude = [*inputs, *model.parameters(), *model.buffers()]
    output, saved = saved_activation_bytes(lambda: call(*inputs), exclude=exclude)
    loss = loss_fn(output, *inputs)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return StepResult(loss.detach(), grads, buffers, saved)


def eager_reference(model: nn.Module, inputs, loss_fn, seed: int = 1234) -> StepResult:
    reference = copy.deepcopy(model)
    return run_step(reference, reference, inputs, loss_fn, seed)


def assert_same_step(actual: StepResult, expected: StepResult, tol: float = 1e-5) -> None:
    """Loss and every gradient within ``tol`` scaled to the magnitude; buffers equal."""
    scale = max(1.0, expected.loss.abs().item())
    assert abs(actual.loss.item() - expected.loss.item()) <= tol * scale, (actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        difference = (actual.grads[name] - grad).abs().max().item()
        assert difference <= tol * max(1.0, grad.abs().max().item()), f"gradient of {name} differs by {difference}"
    assert actual.buffers.keys() == expected.buffers.keys()
    for name, buffer in expected.buffers.items():
        torch.testing.assert_close(actual.buffers[name], buffer, rtol=tol, atol=tol, msg=f"buffer {name}")


def optimize_and_step(model: nn.Module, inputs, loss_fn, budget: float | int, fallback: float | None = None,
                      on_retry: Callable[[], None] = lambda: None):
    """``optimize`` at a saved-bytes ``budget`` and one step through the result: (optimized, step,
    budget used). Where ``budget`` is ``fallback`` (a fraction that may be below the smallest
    feasible budget) and is refused, the error must state a larger minimum, and that minimum is
    used (``on_retry`` runs first: to reset what the failed try recorded)."""
    try:
        optimized = remat_pass.optimize(model, budget=budget, budget_kind="saved")
        return optimized, run_step(model, optimized, inputs, loss_fn), budget
    except BudgetInfeasibleError as error:
        assert fallback is not None and budget == fallback, f"{budget} should be feasible"
        assert error.min_bytes > budget * error.keep_all_bytes
        torch._dynamo.reset()
        on_retry()
        optimized = remat_pass.optimize(model, budget=error.min_bytes, budget_kind="saved")
        return optimized, run_step(model, optimized, inputs, loss_fn), error.min_bytes


def set_hf_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Hugging Face's own per-layer checkpointing on or off, non-reentrant, by whichever name the
    installed transformers has (``activation_checkpointing_*`` replaced ``gradient_checkpointing_*``
    within the 5.x range the pyproject allows)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if not enabled:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# The oldest transformers whose OPT skips LayerDrop's random draw at layerdrop 0 and whose
# Mixtral routes its experts without a data-dependent loop (5.22.2 fails both; tests/deps_matrix.py).
TRANSFORMERS_ONE_GRAPH_MOE_AND_OPT = "5.23"


def transformers_older_than(version: str) -> bool:
    """Whether the installed transformers predates ``version`` (for features it added)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


def fraction_bound(plan, fraction: float) -> float:
    """The most a plan at a saved-bytes ``fraction`` may keep: the fraction of what it keeps beyond
    its graph's own inputs, those on top (``remat_pass.planning.pipeline.resolve_budget``)."""
    from remat_pass.planning.pipeline import kept_input_bytes

    inputs = kept_input_bytes(plan.problem, plan)
    return inputs + fraction * (plan.keep_all_bytes - inputs)


def fitted_against_torch_compile(module: nn.Module, inputs, scale: float = 1.0, tolerance: float = 0.0):
    """``module``'s step under the remat backend on Inductor, at a peak budget of ``scale`` times
    the activation peak of torch.compile's own step (Inductor, no remat, a copy of ``module``):
    asserts the step measures within the budget and equals torch.compile's loss and gradients bit
    for bit (the same seed before each step: dropout included), or within ``tolerance`` of each
    gradient's largest entry (where torch.compile's own step is not deterministic: an embedding's
    gradient accumulated by several threads). Returns the backend, for its plans."""
    from remat_pass.runtime.measure import allocator_peak

    reference = copy.deepcopy(module)

    def step_of(compiled):
        def step():
            torch.manual_seed(7)
            loss = compiled(*inputs)
            loss.backward()
            return loss
        return step

    def peak(compiled, owner: nn.Module) -> int:
        step_of(compiled)()  # compiles; not measured
        owner.zero_grad(set_to_none=True)
        return allocator_peak(step_of(compiled), "cpu", lambda: [p.grad for p in owner.parameters()]).peak_excluding

    plain = torch.compile(reference)
    budget = int(scale * peak(plain, reference))
    backend = remat_pass.backend(budget=budget, budget_kind="peak", inner="inductor", plan_cache=False)
    compiled = torch.compile(module, backend=backend)
    assert peak(compiled, module) <= budget
    module.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    assert torch.equal(step_of(compiled)(), step_of(plain)())
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        close = (p.grad - q.grad).abs().max() <= tolerance * q.grad.abs().max() if tolerance else torch.equal(p.grad, q.grad)
        assert close, name
    return backend
