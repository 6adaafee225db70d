"""Measured op costs (costs="measure", remat_pass.annotate.op_timing): sane prices, eager's gradients, no trace left."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass.annotate.annotate import annotate, tangent_dependent
from remat_pass.capture.capture import capture
from remat_pass.examples import GPTConfig
from remat_pass.annotate.op_timing import Unmeasurable, measure_forward_ops
from remat_pass.planning.pipeline import trace_step

from .helpers import eager_reference, run_step
from .models import ConvNet, GPTWithLoss


class BigAndSmall(nn.Module):
    """A 256x256 matmul over 512 rows (67 MFLOPs) beside a sigmoid of 4 numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(256, 256, bias=False)
        self.small = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x).tanh().sum() + self.small.sigmoid().sum()


def _op(problem, prefix: str):
    (value,) = [v for v in problem.values if v.op.startswith(prefix)]
    return value


def test_measured_costs_are_positive_and_rank_a_big_matmul_above_a_tiny_pointwise_op(caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="remat_pass.annotate.op_timing"):
        problem = trace_step(BigAndSmall(), torch.randn(512, 256), costs="measure").problem
    assert "measured" in caplog.text and "roofline instead" not in caplog.text
    assert problem.costs == "measure"
    matmul, tiny = _op(problem, "mm."), _op(problem, "sigmoid.")
    assert matmul.recompute_seconds > 10 * tiny.recompute_seconds > 0
    computed = [v for v in problem.values if not v.available and "view" not in v.tags and v.op != "getitem"]
    assert computed and all(v.recompute_seconds > 0 for v in computed)
    roofline = trace_step(BigAndSmall(), torch.randn(512, 256)).problem
    assert [v.recompute_seconds for v in problem.values] != [v.recompute_seconds for v in roofline.values]
    assert all(v.recompute_seconds == 0 for v in problem.values if "view" in v.tags)


class WithConstant(nn.Module):
    """A tensor made in the forward from Python numbers: the trace lifts it to a constant of the
    graph's module (a ``get_attr``), as Hugging Face GPT-2's eager attention does with its mask value."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu() * torch.tensor([0.5] * 16)).sum()


def test_a_constant_the_trace_lifted_is_measured_with_its_real_value(caplog):
    """Measuring used to fail on the constant (KeyError, reported as a remat_pass bug); now the op
    that reads it is timed like any other, and the plan gives eager's gradients."""
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="remat_pass.annotate.op_timing"):
        problem = trace_step(WithConstant(), torch.randn(64, 16), costs="measure").problem
    assert problem.costs == "measure" and "roofline instead" not in caplog.text
    assert _op(problem, "mul.").recompute_seconds > 0
    model, inputs = WithConstant(), (torch.randn(64, 16),)
    expected = eager_reference(model, inputs, lambda loss, *_: loss)
    optimized = remat_pass.optimize(model, budget=0.3, costs="measure", example_inputs=inputs)
    actual = run_step(model, optimized, inputs, lambda loss, *_: loss)
    assert torch.equal(actual.loss, expected.loss)
    for name, grad in expected.grads.items():
        assert torch.equal(actual.grads[name], grad), name


def _gpt_case():
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=64, seq_len=32, layers=2, hidden=32, heads=2, dropout=0.1))
    return model, (torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32)))


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_measured_plans_give_eager_gradients_bit_for_bit_with_dropout(budget, caplog):
    """Planned at the first training call, which measures the forward first (dynamo also restores
    the RNG around compiling; measuring restores it itself: the test below checks that directly)."""
    model, inputs = _gpt_case()
    expected = eager_reference(model, inputs, lambda loss, *_: loss)
    optimized = remat_pass.optimize(model, budget=budget, costs="measure")
    with caplog.at_level(logging.INFO, logger="remat_pass.annotate.op_timing"):
        actual = run_step(model, optimized, inputs, lambda loss, *_: loss)
    assert "measured" in caplog.text and "roofline instead" not in caplog.text
    assert optimized.plan.recomputed
    assert torch.equal(actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        assert torch.equal(actual.grads[name], grad), name


@pytest.mark.parametrize("make", [_gpt_case, lambda: (ConvNet(), (torch.randn(4, 3, 8, 8),))])
def test_measuring_leaves_rng_parameters_and_buffers_as_they_were(make):
    model, inputs = make()
    (joint,) = capture(model, inputs)
    state = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    seconds = measure_forward_ops(joint.module.graph, joint.step_inputs, tangent_dependent(joint.module.graph))
    assert seconds and all(s >= 0 for s in seconds.values())
    assert torch.equal(torch.get_rng_state(), rng)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(tensor, state[name]), name
        assert tensor.grad is None


def test_bad_costs_are_a_clear_error():
    with pytest.raises(ValueError, match="costs must be one of 'roofline', 'flops', 'measure'"):
        remat_pass.optimize(nn.Linear(2, 2), costs="measured")
    with pytest.raises(ValueError, match="costs must be one of"):
        remat_pass.backend(costs=None)
    with pytest.raises(ValueError, match="costs must be one of"):
        remat_pass.plan(nn.Linear(2, 2), torch.randn(3, 2), costs=["flops"])


def test_meta_tensors_fall_back_to_the_roofline_with_a_warning(caplog):
    with torch.device("meta"):
        model = BigAndSmall()
    x = torch.empty(512, 256, device="meta")
    with caplog.at_level(logging.WARNING, logger="remat_pass.annotate.op_timing"):
        measured = remat_pass.plan(model, x, budget=0.5, device="cpu", costs="measure")
    assert "fake tensors" in caplog.text and "roofline instead" in caplog.text
    assert measured.problem.costs == "roofline"  # what really priced it
    roofline = remat_pass.plan(model, x, budget=0.5, device="cpu")
    assert [v.recompute_seconds for v in measured.problem.values] == [v.recompute_seconds for v in roofline.problem.values]


def test_graph_without_its_real_inputs_is_unmeasurable():
    model = BigAndSmall()
    (joint,) = capture(model, (torch.randn(8, 256),))  # the input tensor is gone once capture returns
    with pytest.raises(Unmeasurable, match="real inputs are not available"):
        measure_forward_ops(joint.module.graph, joint.step_inputs, tangent_dependent(joint.module.graph))
    priced = annotate(joint, costs="measure").problem  # the roofline prices it instead
    assert _op(priced, "mm.").recompute_seconds == _op(annotate(joint).problem, "mm.").recompute_seconds


def test_flops_device_is_an_alias_of_flops_costs():
    torch.manual_seed(0)
    model, x = BigAndSmall(), torch.randn(64, 256)
    by_costs = trace_step(model, x, costs="flops").problem
    by_device = trace_step(model, x, device="flops").problem
    assert by_costs == by_device and by_costs.device == "cpu"  # the memory model stays the CPU's
    assert by_costs.costs == "flops" and '"costs": "flops"' in remat_pass.solvers.solve(by_costs, None).to_json()
    matmul = _op(by_costs, "mm.")
    assert matmul.recompute_seconds == pytest.approx(1e-9 + matmul.flops / 1e12)
