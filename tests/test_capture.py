"""Capture and the module optimize returns: signatures, errors, sharing, no mutation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import CaptureError

from .helpers import assert_same_step, eager_reference, run_step
from .models import make_case


def test_new_input_signature_replans_and_never_reuses_a_plan():
    model, (tokens,), loss_fn = make_case("gpt")
    optimized = remat_pass.optimize(model, budget=0.5)
    optimized(tokens).sum().backward()
    first = optimized.plan
    shorter = tokens[:, :8]
    optimized(shorter).sum().backward()
    second = optimized.plan
    assert len(optimized.plans) == 2
    assert second is not first
    assert second.keep_all_bytes < first.keep_all_bytes  # planned for the shorter sequence
    optimized(tokens).sum().backward()
    assert optimized.plan is first  # back to the first signature: its own plan
    optimized.eval()
    optimized(tokens).sum().backward()
    assert len(optimized.plans) == 3  # eval mode is another signature (dropout off)
    assert optimized.plan.keep_all_bytes < first.keep_all_bytes


def test_no_grad_calls_run_the_original_without_planning():
    model, inputs, _ = make_case("mlp")
    optimized = remat_pass.optimize(model, budget=0.5)
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs))
    assert optimized.plan is None and not optimized.plans


def test_example_inputs_plan_ahead_without_touching_buffers_or_rng():
    model, inputs, loss_fn = make_case("cnn")
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    optimized = remat_pass.optimize(model, budget=0.6, example_inputs=inputs)
    assert optimized.plan is not None
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    expected = eager_reference(model, inputs, loss_fn)
    assert_same_step(run_step(model, optimized, inputs, loss_fn), expected)


def test_shares_parameters_and_state_dict_round_trips():
    model, inputs, loss_fn = make_case("gpt")
    optimized = remat_pass.optimize(model, budget=0.5)
    assert list(optimized.parameters()) == list(model.parameters())
    state = optimized.state_dict()
    assert state.keys() == model.state_dict().keys()
    fresh, _, _ = make_case("gpt", seed=5)
    fresh_optimized = remat_pass.optimize(fresh, budget=0.5)
    fresh_optimized.load_state_dict(state)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, state[name])


def test_original_module_is_not_modified():
    model, inputs, loss_fn = make_case("gpt")
    reference = copy.deepcopy(model)
    attributes = set(vars(model))
    optimized = remat_pass.optimize(model, budget=0.3)
    run_step(model, optimized, inputs, loss_fn)
    # torch.compile itself marks the module it wraps with this private flag; nothing else changes.
    assert set(vars(model)) - {"_is_torch_compile"} == attributes
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert type(model).forward is type(reference).forward
    for name, value in reference.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name  # no optimizer step: weights unchanged
    assert model.training


def test_train_and_eval_follow_the_original():
    model, inputs, loss_fn = make_case("gpt")
    optimized = remat_pass.optimize(model, budget=0.5)
    optimized.eval()
    assert not model.training
    optimized.train()
    assert model.training


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # needs the value: cannot be one graph
            return y.relu()
        return y.tanh()


def test_data_dependent_control_flow_is_a_capture_error_with_a_way_out():
    optimized = remat_pass.optimize(DataDependent(), budget=0.5)
    with pytest.raises(CaptureError) as raised:
        optimized(torch.randn(2, 4))
    message = str(raised.value)
    assert "could not capture" in message and "remat_pass.backend" in message


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="nn.Module"):
        remat_pass.optimize(lambda x: x, budget=0.5)
