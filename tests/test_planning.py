"""``remat_pass.plan``: planning a step without running it, from real, meta and fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import remat_pass
from remat_pass.examples import GPT, GPTConfig
from remat_pass.planning.plan_model import plan_with_report
from remat_pass.tools.report import block_depth, report

CONFIG = GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=2, dropout=0.1)


def names(plan: remat_pass.Plan, ids: frozenset[int]) -> set[str]:
    return {plan.problem.values[i].name for i in ids}


def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@pytest.fixture(scope="module")
def real_plan() -> remat_pass.Plan:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    plan = remat_pass.plan(model, (tokens,), budget=0.5, device="h100", loss_fn=loss)
    torch._dynamo.reset()
    return plan


def test_meta_plan_equals_the_real_plan(real_plan: remat_pass.Plan) -> None:
    with torch.device("meta"):
        model = GPT(CONFIG)
    parameters = list(model.parameters())
    tokens = torch.zeros(2, CONFIG.seq_len, dtype=torch.long, device="meta")
    plan = remat_pass.plan(model, (tokens,), budget=0.5, device="h100", loss_fn=loss)
    assert names(plan, plan.kept) == names(real_plan, real_plan.kept)
    assert names(plan, plan.recomputed) == names(real_plan, real_plan.recomputed)
    assert (plan.kept_bytes, plan.keep_all_bytes) == (real_plan.kept_bytes, real_plan.keep_all_bytes)
    assert plan.solver == "fast" and plan.predicted_peak_bytes is not None
    # The model is given back as it was: the same meta parameters.
    assert list(model.parameters()) == parameters and all(p.device.type == "meta" for p in parameters)


def test_fake_tensor_plan_equals_the_real_plan(real_plan: remat_pass.Plan) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = GPT(CONFIG)
        tokens = torch.zeros(2, CONFIG.seq_len, dtype=torch.long)
    plan = remat_pass.plan(model, (tokens,), budget=0.5, device="h100", loss_fn=loss)
    assert names(plan, plan.recomputed) == names(real_plan, real_plan.recomputed)
    assert plan.kept_bytes == real_plan.kept_bytes


def test_meta_planning_allocates_nothing() -> None:
    """Weights of 16 TiB: a real allocation (a real step) would fail at once; planning from meta works."""
    config = GPTConfig(vocab_size=2**36, seq_len=16, layers=1, hidden=64, heads=2, dropout=0.0)
    with torch.device("meta"):
        model = GPT(config)
    with pytest.raises(RuntimeError):
        torch.empty(2**36, 64)  # what materializing the embedding would need
    tokens = torch.zeros(1, config.seq_len, dtype=torch.long, device="meta")
    plan = remat_pass.plan(model, (tokens,), budget=0.5)
    assert plan.predicted_peak_bytes > 2**36  # the logits and their gradient alone
    assert all(p.device.type == "meta" for p in model.parameters())


def test_report_lists_each_block() -> None:
    with torch.device("meta"):
        model = GPT(CONFIG)
    tokens = torch.zeros(2, CONFIG.seq_len, dtype=torch.long, device="meta")
    made = plan_with_report(model, (tokens,), budget=0.4, loss_fn=loss)
    assert block_depth(made.plan.problem) == 2
    text = made.render()
    for needle in ("blocks.0 ", "blocks.1 ", "activations kept", "predicted peak", "recompute", "of the step's"):
        assert needle in text, needle
    assert made.step_flops > 0 and made.forward_seconds > 0
    assert "per module" in report(made.plan, depth=1)


def test_peak_budget_with_the_fast_solver() -> None:
    with torch.device("meta"):
        model = GPT(CONFIG)
    tokens = torch.zeros(2, CONFIG.seq_len, dtype=torch.long, device="meta")
    loose = remat_pass.plan(model, (tokens,), budget=1.0, budget_kind="peak")
    budget = int(loose.predicted_peak_bytes * 0.8)
    plan = remat_pass.plan(model, (tokens,), budget=budget)  # an absolute size bounds the peak
    assert plan.budget_kind == "peak" and plan.budget_bytes == budget
    assert plan.predicted_peak_bytes <= budget
    with pytest.raises(remat_pass.BudgetInfeasibleError) as error:
        remat_pass.plan(model, (tokens,), budget=1024)
    assert error.value.kind == "peak" and error.value.min_bytes > 1024


class Broken(nn.Module):
    """Two graphs: a graph break between the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.second(h)).sum()


def test_graph_breaks_are_planned_as_one_step() -> None:
    with torch.device("meta"):
        model = Broken()
    made = plan_with_report(model, (torch.zeros(4, 16, device="meta"),), budget=0.5, solver="ilp")
    assert made.pieces == 2
    assert made.plan.kept_bytes <= made.plan.keep_all_bytes // 2


def test_bad_arguments() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="unknown solver"):
        remat_pass.plan(model, (torch.zeros(2, 4),), solver="nope")
    with pytest.raises(ValueError, match="budget_kind"):
        remat_pass.plan(model, (torch.zeros(2, 4),), budget_kind="sometimes")


# --- how long planning takes: fast by default, proof work on request ------------------------


@pytest.fixture
def peak_options(monkeypatch):
    """The options every front door hands the peak planner, one dict per solve."""
    import functools

    from remat_pass import solvers

    seen: list[dict] = []
    original = solvers.SOLVERS["ilp_peak"]

    @functools.wraps(original)
    def recording(problem, budget_bytes=None, **options):
        seen.append({k: options.get(k) for k in ("time_limit", "prove", "refusal_time_limit")})
        return original(problem, budget_bytes, **options)

    monkeypatch.setitem(solvers.SOLVERS, "ilp_peak", recording)
    return seen


def _mlp_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
    return model, torch.randn(256, 16)


@pytest.mark.parametrize("given, expected", [
    ({}, {"time_limit": 2.0, "prove": False, "refusal_time_limit": 10.0}),
    ({"time_limit": 7}, {"time_limit": 7, "prove": True, "refusal_time_limit": None}),
    ({"prove": True}, {"time_limit": 60.0, "prove": True, "refusal_time_limit": None}),
    ({"time_limit": 7, "prove": False}, {"time_limit": 7, "prove": False, "refusal_time_limit": 10.0}),
    ({"time_limit": 30, "prove": False}, {"time_limit": 30, "prove": False, "refusal_time_limit": 30}),
])
def test_every_front_door_plans_fast_by_default_and_proves_on_request(peak_options, given, expected) -> None:
    """``optimize``, ``backend``, ``plan`` and ``explain``: by default 2 s and no proof work, a budget
    refused only after 10 s of search; an explicit ``time_limit`` means proving within it;
    ``prove=True`` alone, within 60 s."""
    from remat_pass.tools.explain import explain

    model, x = _mlp_case()
    budget = dict(budget=0.9, budget_kind="peak", plan_cache=False)  # every front door solves
    torch._dynamo.reset()
    remat_pass.optimize(model, example_inputs=(x,), **budget, **given)
    torch._dynamo.reset()
    torch.compile(model, backend=remat_pass.backend(**budget, **given))(x).sum().backward()
    torch._dynamo.reset()
    remat_pass.plan(model, (x,), device="cpu", solver="ilp", **budget, **given)
    torch._dynamo.reset()
    explain(model, (x,), 0.9, budget_kind="peak", plan_cache=False, **given)
    torch._dynamo.reset()
    assert peak_options == [expected] * 4


def test_planning_effort_rejects_what_is_not_a_limit() -> None:
    from remat_pass.planning.effort import planning_effort

    with pytest.raises(ValueError, match="time_limit"):
        planning_effort(0, None)
    with pytest.raises(TypeError, match="prove"):
        planning_effort(None, "yes")


def test_the_status_line_claims_no_more_than_was_proven(real_plan: remat_pass.Plan) -> None:
    import dataclasses

    from remat_pass.planning.pipeline import describe_status

    said = [describe_status(dataclasses.replace(real_plan, status=status, gap=gap))
            for status, gap in (("optimal", 0.0), ("feasible", 0.175), ("feasible", None), ("time_limit", 0.3))]
    assert said == ["optimal", "feasible, proven gap 17.5%", "feasible, gap unknown", "time_limit, proven gap 30.0%"]
