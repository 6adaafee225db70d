"""Training BatchNorm is recomputed without its running statistics (remat_pass.annotate.batch_norm)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import solvers
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.runtime.measure import peak_activation_bytes
from remat_pass.rewrite.rewrite import rewrite
from remat_pass.rewrite.simulate import simulate
from remat_pass.solvers.analysis.memory import simulate_plan

from .helpers import eager_reference, run_step
from .models import make_case

aten = torch.ops.aten


class _WithLoss(nn.Module):
    """The ConvNet with its loss inside the graph, so a peak budget covers the whole step."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().mean()


def _assert_equal_step(actual, expected) -> None:
    assert torch.equal(actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        assert torch.equal(actual.grads[name], grad), f"gradient of {name}"
    assert actual.buffers.keys() == expected.buffers.keys()
    for name, buffer in expected.buffers.items():
        assert torch.equal(actual.buffers[name], buffer), f"buffer {name}"


def _recomputed_batch_norms(plan) -> list[str]:
    return [plan.problem.values[i].name for i in plan.recomputed
            if plan.problem.values[i].op == "_native_batch_norm_legit_functional.default"]


@pytest.mark.parametrize("dtype, param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])  # the last: autocast's mix
def test_no_stats_matches_the_functional_op_bit_for_bit(dtype, param_dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 5, 5, dtype=dtype)
    weight, bias = torch.randn(8, dtype=param_dtype), torch.randn(8, dtype=param_dtype)
    mean, var = torch.randn(8, dtype=param_dtype), torch.rand(8, dtype=param_dtype)
    functional = aten._native_batch_norm_legit_functional.default(x, weight, bias, mean, var, True, 0.1, 1e-5)
    no_stats = aten._native_batch_norm_legit.no_stats(x, weight, bias, True, 0.1, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(functional[:3], no_stats))
    grad = torch.randn_like(x)
    with_stats = aten.native_batch_norm_backward(grad, x, weight, functional[3], functional[4], functional[1],
                                                 functional[2], True, 1e-5, [True, True, True])
    without = aten.native_batch_norm_backward(grad, x, weight, None, None, functional[1], functional[2], True, 1e-5,
                                              [True, True, True])
    assert all(torch.equal(a, b) for a, b in zip(with_stats, without))


def test_smallest_saved_budget_recomputes_batch_norm_exactly():
    model, inputs, loss_fn = make_case("cnn")
    expected = eager_reference(model, inputs, loss_fn)
    optimized = remat_pass.optimize(model, budget=0.05, budget_kind="saved")
    actual = run_step(model, optimized, inputs, loss_fn)
    assert _recomputed_batch_norms(optimized.plan)
    _assert_equal_step(actual, expected)
    assert actual.buffers["bn1.num_batches_tracked"].item() == 1


def test_plan_and_graph_replay_agree_with_batch_norm_recomputed():
    model, inputs, _ = make_case("cnn")
    (joint,) = capture(_WithLoss(model), inputs)
    annotated = annotate(joint)
    problem = annotated.problem
    for fraction in (0.0, 0.3):
        plan = solvers.solve(problem, int(fraction * problem.keep_all_bytes()), solver="ilp")
        assert _recomputed_batch_norms(plan)
        assert simulate_plan(problem, plan).peak_bytes == simulate(*rewrite(annotated, plan)).peak_bytes


class _TinyResNet(nn.Module):
    """Stem and two residual blocks of conv-BN-ReLU, loss inside: a peak budget covers the step."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(block(x) + x)
        return x.mean((2, 3)).square().mean()


@pytest.mark.parametrize("fraction", [0.9, 0.8])
def test_low_peak_budget_recomputes_batch_norm_and_is_kept(fraction):
    torch.manual_seed(0)
    model, inputs = _TinyResNet(), (torch.randn(4, 3, 16, 16),)
    expected = eager_reference(model, inputs, lambda loss, *_: loss)
    probe = remat_pass.optimize(model, budget=1.0, example_inputs=inputs)
    limit = int(fraction * probe.plan.predicted_peak_bytes)
    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, budget=limit, budget_kind="peak", example_inputs=inputs)
    assert _recomputed_batch_norms(optimized.plan)
    assert optimized.plan.predicted_peak_bytes <= limit
    _assert_equal_step(run_step(model, optimized, inputs, lambda loss, *_: loss), expected)
    torch.manual_seed(1234)
    _, measured = peak_activation_bytes(lambda: optimized(*inputs).backward(),
                                        survivors=lambda: [p.grad for p in model.parameters()])
    assert measured <= limit, f"measured peak {measured} over the {limit}-byte budget"
