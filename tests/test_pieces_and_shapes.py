"""optimize beyond one static graph: graph breaks (``fullgraph=False``: every piece planned) and
dynamic shapes (``dynamic=True``: one plan for every length, a peak budget fitted on Inductor too)."""

from __future__ import annotations

import copy
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
    held = 0
    for plan in pieces:
        if isinstance(budget, float):  # a fraction of each piece's own reference
            assert plan.kept_bytes <= budget * plan.keep_all_bytes
        else:  # a peak budget: each piece peaks within what the earlier pieces' saved tensors leave
            assert plan.budget_bytes == 64_000 - held and plan.predicted_peak_bytes <= plan.budget_bytes
            held += plan.kept_bytes
    assert any("graph breaks" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


class SplitStack(nn.Module):
    """Two MLP stacks with a data-dependent branch between them (two pieces), BatchNorm and dropout in
    the first, the loss inside: what the step peaks at is the whole step's."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.norm, self.drop = nn.BatchNorm1d(width), nn.Dropout(0.1)
        self.first = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                   for _ in range(depth))
        self.second = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                                    for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(x))
        for block in self.first:
            x = x + block(x)
        if x.sum() > 0:  # data-dependent: a graph break
            x = x * 2
        for block in self.second:
            x = x + block(x)
        return x.square().mean()


def _step_peak(call, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """The step's activation peak at the allocator (the parameter gradients left out)."""
    from remat_pass.runtime.measure import allocator_peak

    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(1234)
    peak = allocator_peak(lambda: call(*inputs).backward(), "cpu", lambda: [p.grad for p in model.parameters()])
    return peak.peak_excluding


@pytest.mark.parametrize("fraction", [0.6, 0.4])
def test_a_peak_budget_is_shared_by_the_pieces_of_a_step(fraction, caplog):
    """Each piece planned at the whole budget peaked at 1.5x it; now a piece keeps what leaves the
    later pieces their lowest peaks (learnt from a refusal: the first call runs again from the same
    buffers and RNG state) and peaks within what the earlier pieces leave."""
    torch.manual_seed(0)
    model, inputs = SplitStack(), (torch.randn(256, 64),)
    expected = eager_reference(model, inputs, lambda loss, *_: loss)
    budget = int(fraction * _step_peak(copy.deepcopy(model), model, inputs))
    caplog.set_level(logging.WARNING, logger="remat_pass")
    optimized = remat_pass.optimize(model, budget=budget, budget_kind="peak", fullgraph=False, plan_cache=False)
    actual = run_step(model, optimized, inputs, lambda loss, *_: loss)
    assert_same_step(actual, expected)  # dropout's masks and BatchNorm's statistics as eager's, once
    assert len(optimized.pieces) == 2
    assert any("reserved for it" in r.getMessage() for r in caplog.records)  # a piece was refused, then fitted
    assert _step_peak(optimized, model, inputs) <= budget
    first, second = optimized.pieces
    assert second.budget_bytes == budget - first.kept_bytes and second.predicted_peak_bytes <= second.budget_bytes


@pytest.mark.slow
def test_a_peak_budget_is_shared_by_the_pieces_of_a_step_on_inductor():
    """The same under Inductor's fit: a piece planned again at its next run is fitted from that run's inputs."""
    torch.manual_seed(0)
    model, inputs = SplitStack(), (torch.randn(256, 64),)
    model.drop.p = 0.0  # Inductor draws its own dropout masks; the gradients are compared with eager's
    expected = eager_reference(model, inputs, lambda loss, *_: loss)
    budget = int(0.6 * _step_peak(copy.deepcopy(model), model, inputs))
    optimized = remat_pass.optimize(model, budget=budget, budget_kind="peak", fullgraph=False, inner="inductor",
                                    plan_cache=False)
    actual = run_step(model, optimized, inputs, lambda loss, *_: loss)
    assert_same_step(actual, expected)
    assert len(optimized.pieces) == 2 and _step_peak(optimized, model, inputs) <= budget


def test_the_backend_says_a_peak_budget_bounds_each_of_its_graphs_on_its_own(caplog):
    """Outside optimize nothing says which graphs make one step: the backend says what the budget bounds."""
    torch.manual_seed(0)
    model = SplitStack()
    caplog.set_level(logging.WARNING, logger="remat_pass")
    compiled = torch.compile(model, backend=remat_pass.backend(budget="100MB", inner="eager", plan_cache=False))
    compiled(torch.randn(256, 64)).backward()
    assert any("bounds each graph this backend compiles on its own" in r.getMessage() for r in caplog.records)


def test_the_backend_does_not_take_a_recompile_for_a_second_piece(caplog):
    """A recompile of one frame (a new batch size) runs instead of the first graph, not beside it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    caplog.set_level(logging.WARNING, logger="remat_pass")
    compiled = torch.compile(model, backend=remat_pass.backend(budget="100MB", inner="eager", plan_cache=False))
    for rows in (256, 128):
        compiled(torch.randn(rows, 64)).square().mean().backward()
    assert not any("bounds each graph" in r.getMessage() for r in caplog.records)


def test_a_peak_budget_below_the_pieces_lowest_peaks_is_refused_untouched():
    """Just over the first piece's own lowest peak, the pieces together cannot fit: the refusal says
    what the other pieces take, and the refused calls leave BatchNorm's statistics untouched."""
    torch.manual_seed(0)
    model, inputs = SplitStack(), (torch.randn(256, 64),)
    tiny = remat_pass.optimize(model, budget=int(0.05 * _step_peak(copy.deepcopy(model), model, inputs)),
                               budget_kind="peak", fullgraph=False, plan_cache=False)
    with pytest.raises(remat_pass.BudgetInfeasibleError) as first_alone:
        tiny(*inputs)
    optimized = remat_pass.optimize(model, budget=first_alone.value.min_bytes + 1, budget_kind="peak", fullgraph=False,
                                    plan_cache=False)
    with pytest.raises(remat_pass.BudgetInfeasibleError, match="of a step split at graph breaks"):
        optimized(*inputs)
    assert model.norm.num_batches_tracked.item() == 0


class BranchInLoop(nn.Module):
    """A data-dependent branch inside the loop over the blocks: dynamo cannot resume there and runs the
    whole forward eagerly, compiling nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
            if x.sum() > 0:
                x = x * 2
        return x


def test_a_step_dynamo_runs_eagerly_is_an_error_not_a_budget_ignored():
    torch.manual_seed(0)
    optimized = remat_pass.optimize(BranchInLoop(), budget=0.5, fullgraph=False, plan_cache=False)
    with pytest.raises(CaptureError, match="without compiling any graph.*the budget was not applied"):
        optimized(torch.randn(4, 16))


def test_a_frame_past_dynamos_recompile_limit_is_an_error_not_a_budget_ignored():
    """Past the limit dynamo runs the frame eagerly without raising where graph breaks are allowed."""
    torch.manual_seed(0)
    optimized = remat_pass.optimize(DataDependent(), budget=0.5, fullgraph=False, plan_cache=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        optimized(torch.randn(4, 16))
        with pytest.raises(CaptureError, match="recompile limit"):
            optimized(torch.randn(5, 16))  # a new batch size: a recompile of the same frame


def test_with_dynamo_disabled_the_step_runs_eagerly_as_asked(caplog, monkeypatch):
    """TORCHDYNAMO_DISABLE=1 turns every torch.compile into eager for debugging: optimize then trains
    eagerly too, with a warning, instead of raising that nothing was compiled."""
    torch.manual_seed(0)
    model, inputs = DataDependent(), (torch.randn(4, 16),)
    expected = eager_reference(model, inputs, _loss)
    caplog.set_level(logging.WARNING, logger="remat_pass")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    optimized = remat_pass.optimize(model, budget=0.5, plan_cache=False)
    assert_same_step(run_step(model, optimized, inputs, _loss), expected)
    assert optimized.plan is None and "dynamo is disabled" in caplog.text


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


def test_a_peak_budget_on_inductor_is_fitted_with_dynamic_shapes():
    """Dynamo gives a graph compiled for dynamic shapes its sizes as ``SymInt`` example inputs; the fit
    measured each candidate with them as given, which Inductor's code read as a negative size
    ("Expected result >= 0"): the first dynamic recompile of a peak-budgeted step failed."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=32, layers=2, hidden=32, heads=2, dropout=0.0)
    model = GPT(config)
    optimized = remat_pass.optimize(model, budget="4MB", budget_kind="peak", inner="inductor", dynamic=True)
    for length in (16, 24):
        tokens, targets = torch.randint(0, 64, (2, length)), torch.randint(0, 64, (2, length))

        def loss(logits, *_inputs, targets=targets):
            return lm_loss(logits, targets)

        assert_same_step(run_step(model, optimized, (tokens,), loss), eager_reference(model, (tokens,), loss))
    assert optimized.plan.budget_bytes == 4_000_000
