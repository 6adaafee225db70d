"""End to end: optimize / the "remat" backend give eager's loss and gradients, within budget."""

from __future__ import annotations

import copy

import pytest
import torch

import remat_pass
from remat_pass import solvers
from remat_pass import BudgetInfeasibleError

from .helpers import assert_same_step, eager_reference, fraction_bound, run_step
from .models import CASES, make_case


def _optimized_step(name: str, budget, **options):
    model, inputs, loss_fn = make_case(name)
    expected = eager_reference(model, inputs, loss_fn)
    optimized = remat_pass.optimize(model, budget=budget, **options)
    actual = run_step(model, optimized, inputs, loss_fn)
    return optimized, actual, expected


def _keep_all_problem(name: str):
    model, inputs, loss_fn = make_case(name)
    optimized = remat_pass.optimize(model, budget=1.0, example_inputs=inputs)
    return optimized.plan.problem


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.2])
def test_fraction_budgets_match_eager_and_fit(name, budget):
    try:
        optimized, actual, expected = _optimized_step(name, budget)
    except BudgetInfeasibleError as error:
        assert error.min_bytes > budget * error.keep_all_bytes
        pytest.skip(f"{name} cannot reach {budget}: smallest is {error.min_bytes / error.keep_all_bytes:.2f}")
    assert_same_step(actual, expected)
    plan = optimized.plan
    assert actual.saved_bytes == plan.kept_bytes, "measured saved bytes must equal the prediction"
    assert actual.saved_bytes <= budget * plan.keep_all_bytes
    if budget == 1.0:
        assert not plan.recomputed
        assert actual.saved_bytes == plan.keep_all_bytes


@pytest.mark.parametrize("name", CASES)
def test_smallest_feasible_budget_is_exact(name):
    problem = _keep_all_problem(name)
    smallest = solvers.min_feasible_bytes(problem)
    # 0 is not a valid budget; an absolute budget bounds the peak unless told otherwise; the unit
    # says "bytes" for the tiny models, whose smallest budgets lie below the bare-int floor of 1 KiB
    optimized, actual, expected = _optimized_step(name, f"{max(smallest, 1)}B", budget_kind="saved")
    assert_same_step(actual, expected)
    assert actual.saved_bytes == optimized.plan.kept_bytes == smallest
    if smallest > 0:
        with pytest.raises(BudgetInfeasibleError) as raised:
            _optimized_step(name, f"{smallest - 1}B", budget_kind="saved")
        assert raised.value.min_bytes == smallest
        assert str(smallest) in str(raised.value)


def test_absolute_budget_string_and_int():
    problem = _keep_all_problem("gpt")
    cap = problem.keep_all_bytes() * 3 // 10
    for budget in (cap, f"{cap}B", f"{cap / 1024:.3f}KiB"):
        # Absolute budgets bound the peak by default (tests/test_peak.py); here: saved bytes.
        optimized, actual, expected = _optimized_step("gpt", budget, budget_kind="saved")
        assert_same_step(actual, expected)
        assert actual.saved_bytes == optimized.plan.kept_bytes <= cap


def test_dropout_masks_equal_eager_bit_for_bit():
    model, inputs, loss_fn = make_case("gpt")
    expected = eager_reference(model, inputs, loss_fn)
    optimized = remat_pass.optimize(model, budget=0.3)
    actual = run_step(model, optimized, inputs, loss_fn)
    assert torch.equal(actual.loss, expected.loss)  # same masks, same ops: bit-exact loss
    assert_same_step(actual, expected)


def test_batchnorm_statistics_updated_once_per_step():
    model, inputs, loss_fn = make_case("cnn")
    expected = eager_reference(model, inputs, loss_fn)
    # BatchNorm is recomputed in backward without its running statistics (remat_pass.annotate.batch_norm),
    # so the smallest budget saves almost nothing; the statistics must still move exactly once.
    smallest = solvers.min_feasible_bytes(_keep_all_problem("cnn"))
    optimized = remat_pass.optimize(model, budget=f"{max(smallest, 1)}B", budget_kind="saved")
    actual = run_step(model, optimized, inputs, loss_fn)
    assert any(optimized.plan.problem.values[i].op.startswith("_native_batch_norm") for i in optimized.plan.recomputed)
    assert actual.buffers["bn1.num_batches_tracked"].item() == 1
    assert_same_step(actual, expected)


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_registered_backend_with_eager_inner(name):
    model, inputs, loss_fn = make_case(name)
    expected = eager_reference(model, inputs, loss_fn)
    compiled = torch.compile(model, backend="remat")
    actual = run_step(model, compiled, inputs, loss_fn)
    assert_same_step(actual, expected)


@pytest.mark.backend_default
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_backend_runs_inductor_by_default_with_its_gradients(name):
    """What a torch.compile user compares against: Inductor without remat. The same loss and
    gradients bit for bit (the GPT's dropout included: Inductor's own RNG draws the same masks,
    and no random op is run twice), and each plan within its budget."""
    model, inputs, loss_fn = make_case(name)
    reference = copy.deepcopy(model)
    expected = run_step(reference, torch.compile(reference), inputs, loss_fn)
    torch._dynamo.reset()
    backend = remat_pass.backend(budget=0.3)
    assert backend.inner == "inductor"
    actual = run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    assert torch.equal(actual.loss, expected.loss)
    assert all(torch.equal(actual.grads[name], grad) for name, grad in expected.grads.items())
    assert backend.plans and all(plan.kept_bytes <= fraction_bound(plan, 0.3) for plan in backend.plans)


@pytest.mark.backend_default
def test_the_backend_compiles_with_inductor_under_either_budget_kind():
    """Saved bytes are the plan's whatever compiles it; a peak budget is fitted to Inductor's
    compiled program by measurement (``inductor_fit``), falling back to eager only when Inductor
    was the default, not a request."""
    assert remat_pass.backend(budget=0.3).inner == "inductor"
    assert remat_pass.backend(budget="1GiB", budget_kind="saved").inner == "inductor"
    assert not remat_pass.backend(budget="1GiB", budget_kind="saved").fits_compiled_peak
    peak = remat_pass.backend(budget="1GiB")
    assert peak.inner == "inductor" and peak.fits_compiled_peak and peak._eager_fallback is not None
    assert remat_pass.backend(budget=0.3, budget_kind="peak").fits_compiled_peak
    asked = remat_pass.backend(budget="1GiB", inner="inductor")
    assert asked.fits_compiled_peak and asked._eager_fallback is None
    assert not remat_pass.backend(budget="1GiB", inner="eager").fits_compiled_peak
    with pytest.raises(ValueError, match="inner must be one of"):
        remat_pass.backend(inner="aot_eager")


def test_backend_plans_each_subgraph_between_graph_breaks():
    model, inputs, loss_fn = make_case("mlp")

    class WithBreak(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            x = self.inner.layers[0](x).tanh()
            torch._dynamo.graph_break()
            for layer in self.inner.layers[1:]:
                x = torch.tanh(layer(x)) + x
            return self.inner.out(x)

    wrapped = WithBreak(model)
    expected = eager_reference(wrapped, inputs, loss_fn)
    backend = remat_pass.backend(budget=0.5)
    actual = run_step(wrapped, torch.compile(wrapped, backend=backend), inputs, loss_fn)
    assert_same_step(actual, expected)
    assert len(backend.plans) == 2
