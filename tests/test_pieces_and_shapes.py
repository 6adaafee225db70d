"""optimize beyond one static graph: graph breaks (``fullgraph=False``: every piece planned) and
dynamic shapes (``dynamic=True``: one plan for every length)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import CaptureError
from remat_pass.examples import GPT, GPTConfig, lm_loss

from .helpers import assert_same_step, eager_reference, run_step


class DataDependent(nn.Module):
    """A branch on a tensor's value: dynamo must break the graph there (as MoE routing does)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.second = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if h.sum() > 0:  # data-dependent
            h = h * 2
        return self.second(h)


def _loss(output, *_inputs):
    return output.square().mean()


def test_one_graph_is_required_by_default():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="fullgraph=False"):
        remat_pass.optimize(DataDependent(), budget=0.5)(torch.randn(4, 16))


@pytest.mark.parametrize("budget", [0.5, "64KB"])
def test_graph_breaks_plan_every_piece(budget, caplog):
    torch.manual_seed(0)
    model, inputs = DataDependent(), (torch.randn(4, 16),)
    expected = eager_reference(model, inputs, _loss)
    caplog.set_level(logging.WARNING, logger="remat_pass")
    optimized = remat_pass.optimize(model, budget=budget, fullgraph=False)
    actual = run_step(model, optimized, inputs, _loss)
    assert_same_step(actual, expected)
    pieces = optimized.pieces
    assert len(pieces) >= 2 and optimized.plan is pieces[-1]
    # A piece's inputs are charged to it (they are the previous piece's activations): a storage
    # crossing a break counts in both pieces' plans, once at run time.
    assert actual.saved_bytes <= sum(p.kept_bytes for p in pieces)
    for plan in pieces:
        if isinstance(budget, float):  # a fraction of each piece's own reference
            assert plan.kept_bytes <= budget * plan.keep_all_bytes
        else:  # an absolute budget bounds each piece's peak on its own
            assert plan.budget_bytes == 64_000 and plan.predicted_peak_bytes <= 64_000
    assert any("graph breaks" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_dynamic_shapes_one_plan_for_every_length():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=32, layers=2, hidden=32, heads=2, dropout=0.0)
    model = GPT(config)
    optimized = remat_pass.optimize(model, budget=0.5, dynamic=True)
    plans = set()
    for length in (16, 24, 12):
        tokens = torch.randint(0, 64, (2, length))
        targets = torch.randint(0, 64, (2, length))

        def loss(logits, *_inputs, targets=targets):
            return lm_loss(logits, targets)

        expected = eager_reference(model, (tokens,), loss)
        actual = run_step(model, optimized, (tokens,), loss)
        assert_same_step(actual, expected)
        plans.add(id(optimized.plan))
        if length == 16:  # planned at the first call's shape: the fraction holds there
            assert actual.saved_bytes <= optimized.plan.kept_bytes <= 0.5 * optimized.plan.keep_all_bytes
    assert len(plans) == 1 and len(optimized._backend.plans) == 1
