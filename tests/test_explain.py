"""Plan.per_module / to_dict and remat_pass.tools.explain: per-module bytes checked against hand computation.

The model (tests/explain_factory.py) is a 2-block MLP on x (4, 8) fp32, hidden 16, no biases:
fc1 and tanh outputs are 4*16*4 = 256 bytes, fc2 outputs and residual sums 4*8*4 = 128 bytes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from remat_pass import solvers
from remat_pass.errors import BudgetInfeasibleError
from remat_pass.tools.explain import Explanation, explain, explain_traced
from remat_pass.planning.pipeline import trace_step
from remat_pass.solvers.module_account import ModuleRow
from remat_pass.solvers.problem import Plan, Problem, Value, closure_from_keep_set
from remat_pass.solvers.tags import Tag

from .explain_factory import factory, factory_dropout, factory_with_loss

# Forward: 4 block matmuls of 2*4*8*16 FLOPs and the head's 2*4*8*1. Backward: two matmuls per
# forward one (weight and input gradient), except that x needs no gradient.
STEP_FLOPS = (4 * 1024 + 64) + (7 * 1024 + 2 * 64)


@pytest.fixture(scope="module")
def traced():
    return trace_step(*factory())


def _find(problem: Problem, op: str, module: str) -> int:
    (match,) = [v.id for v in problem.values if v.op.startswith(op) and v.module == module]
    return match


def _numbers(rows: list[ModuleRow]) -> dict[str, tuple]:
    return {r.module: (r.policy, r.kept_bytes, r.recomputed_bytes, r.keep_all_bytes, r.recompute_flops) for r in rows}


def test_step_flops_and_keep_all_rows_match_hand_computation(traced):
    assert traced.step_flops == STEP_FLOPS and traced.pieces == 1
    plan = solvers.solve(traced.problem, None, solver="keep_all")
    assert plan.kept_bytes == 768
    # Backward reads each tanh output (256) and each residual sum (128); nothing else costs bytes.
    assert _numbers(plan.per_module(depth=2)) == {
        "blocks.0": ("none", 384, 0, 384, 0),
        "blocks.1": ("none", 384, 0, 384, 0),
        "head": ("none", 0, 0, 0, 0),
    }
    assert [r.module for r in plan.per_module()] == [
        "blocks.0.fc1", "blocks.0", "blocks.0.fc2", "blocks.1.fc1", "blocks.1", "blocks.1.fc2", "head"]


def test_keeping_only_the_last_residual_recomputes_the_rest(traced):
    problem = traced.problem
    kept, recomputed = closure_from_keep_set(problem, {_find(problem, "add", "blocks.1")})
    plan = Plan(problem, kept, recomputed, solver="manual")
    assert plan.kept_bytes == 128
    # add_1 is kept: it is what the head reads, so blocks.1 is still "full" (checkpointed).
    assert _numbers(plan.per_module()) == {
        "blocks.0.fc1": ("full", 0, 256, 0, 1024),     # fc1 output, one matmul
        "blocks.0": ("full", 0, 256 + 128, 384, 0),     # tanh and the residual sum
        "blocks.0.fc2": ("full", 0, 128, 0, 1024),
        "blocks.1.fc1": ("full", 0, 256, 0, 1024),
        "blocks.1": ("full", 128, 256, 384, 0),          # keeps its output, recomputes tanh
        "blocks.1.fc2": ("none", 0, 0, 0, 0),            # its output is only needed to make add_1
        "head": ("none", 0, 0, 0, 0),
    }
    assert _numbers(plan.per_module(depth=1)) == {"blocks": ("full", 128, 1280, 768, 3072),
                                                  "head": ("none", 0, 0, 0, 0)}
    seconds = {r.module: r.recompute_seconds for r in plan.per_module(depth=2)}
    assert seconds["blocks.0"] == pytest.approx(sum(
        problem.values[i].recompute_seconds for i in recomputed if problem.values[i].module.startswith("blocks.0")))


def test_keeping_an_inner_value_is_selective(traced):
    problem = traced.problem
    tanh = _find(problem, "tanh", "blocks.0")
    fc1 = _find(problem, "mm", "blocks.0.fc1")
    views_of_tanh = {v.id for v in problem.values if v.storage == problem.values[tanh].storage}
    kept, recomputed = closure_from_keep_set(problem, (set(problem.backward_reads) - views_of_tanh) | {fc1})
    plan = Plan(problem, kept, recomputed, solver="manual")
    rows = _numbers(plan.per_module(depth=2))
    # blocks.0 keeps fc1's output (read by tanh, inside the block) and rebuilds tanh from it.
    assert rows["blocks.0"] == ("selective", 256 + 128, 256, 384, 0)
    assert rows["blocks.1"] == ("none", 384, 0, 384, 0)


def test_rows_add_up_to_the_plan_for_the_ilp(traced):
    plan = solvers.solve(traced.problem, 384)
    for depth in (None, 1, 2, 3):
        rows = plan.per_module(depth)
        assert sum(r.kept_bytes for r in rows) == plan.kept_bytes
        assert sum(r.recompute_flops for r in rows) == plan.recompute_flops
        assert sum(r.recompute_seconds for r in rows) == pytest.approx(plan.recompute_seconds)
        assert all(r.policy in ("none", "selective", "full") for r in rows)
    with pytest.raises(ValueError, match="depth"):
        plan.per_module(0)


def test_storages_are_charged_once_to_their_creator():
    """Literal problem: a view made outside any module is charged to its base's module."""
    x = Value(0, "x", (), storage=0, available=True)
    a = Value(1, "a", (0,), storage=1, recompute_seconds=1.0, flops=10, module="m.0.fc")
    b = Value(2, "b", (1,), storage=2, recompute_seconds=2.0, module="m.0")
    view = Value(3, "b_view", (2,), storage=2, module="", tags=frozenset({Tag.VIEW}))
    c = Value(4, "c", (2,), storage=3, recompute_seconds=3.0, flops=30, module="m.1")
    problem = Problem((x, a, b, view, c), (0, 100, 50, 30), frozenset({3, 4}))
    plan = Plan(problem, kept=frozenset({3, 4}), recomputed=frozenset(), solver="manual")
    # The view (module "") makes no storage of its own: no row; its 50 bytes are m.0's.
    assert _numbers(plan.per_module()) == {
        "m.0.fc": ("none", 0, 0, 0, 0), "m.0": ("none", 50, 0, 50, 0), "m.1": ("none", 30, 0, 30, 0)}
    plan = Plan(problem, kept=frozenset({1, 4}), recomputed=frozenset({2, 3}), solver="manual")
    assert _numbers(plan.per_module(depth=2)) == {"m.0": ("selective", 100, 50, 50, 0),
                                                  "m.1": ("none", 30, 0, 30, 0)}
    assert _numbers(plan.per_module(depth=1)) == {"m": ("selective", 130, 50, 80, 0)}


def test_to_json_round_trip(traced):
    plan = solvers.solve(traced.problem, 384)
    data = json.loads(plan.to_json(depth=2))
    problem = traced.problem
    assert data["solver"] == "ilp" and data["status"] == plan.status and data["budget_bytes"] == 384
    assert (data["kept_bytes"], data["keep_all_bytes"]) == (plan.kept_bytes, 768)
    assert data["recompute_flops"] == plan.recompute_flops
    assert data["recompute_seconds"] == pytest.approx(plan.recompute_seconds)
    assert {e["name"] for e in data["kept"]} == {problem.values[i].name for i in plan.kept}
    assert {e["name"] for e in data["recomputed"]} == {problem.values[i].name for i in plan.recomputed}
    for entry in data["kept"]:
        value = problem.values[entry["id"]]
        assert (entry["op"], entry["module"], entry["bytes"]) == (
            value.op, value.module, problem.storage_bytes[value.storage])
    assert data["per_module"] == [dataclasses.asdict(r) for r in plan.per_module(depth=2)]
    assert "Plan by ilp" in plan.summary() and "kept" in plan.summary() and "recomputed" in plan.summary()


def test_explain_api_renders_and_serializes(traced):
    explanation = explain_traced(traced, 0.5, depth=2)
    assert isinstance(explanation, Explanation)
    plan = explanation.plan
    assert plan.budget_bytes == 384 and plan.kept_bytes <= 384
    assert explanation.rows == plan.per_module(2)
    assert explanation.flop_overhead == pytest.approx(plan.recompute_flops / STEP_FLOPS)
    text = str(explanation)
    assert "Plan by ilp" in text and "blocks.0" in text and "total" in text
    data = json.loads(json.dumps(explanation.to_dict()))
    assert data["budget"] == {"fraction": 0.5, "bytes": None} and data["step_flops"] == STEP_FLOPS


def test_explain_with_a_loss_keeps_the_users_module_paths():
    model, inputs, loss_fn = factory_with_loss()
    explanation = explain(model, inputs, budget=1.0, loss_fn=loss_fn)
    modules = [r.module for r in explanation.rows]
    assert modules[:2] == ["blocks.0.fc1", "blocks.0"] and not any(m.startswith("model") for m in modules)
    # square().mean() keeps the head's 4x1 output for backward (out * 2): 16 bytes more than without a loss.
    assert explanation.plan.kept_bytes == 768 + 16
    assert "" in modules  # the loss's values belong to no module


def test_explain_raises_below_the_smallest_feasible_budget():
    model, inputs = factory_dropout()
    with pytest.raises(BudgetInfeasibleError) as info:
        explain(model, inputs, budget="32B", budget_kind="saved")
    assert info.value.min_bytes == 64  # the dropout mask, 4*16 bools: never recomputed


def test_pieces_between_graph_breaks_are_planned_as_one_problem():
    import torch

    model, inputs = factory()

    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.head = model.blocks, model.head

        def forward(self, x):
            x = self.blocks[0](x)
            torch._dynamo.graph_break()
            return self.head(self.blocks[1](x))

    traced = trace_step(Broken(), inputs)
    assert traced.pieces == 2 and traced.step_flops == STEP_FLOPS
    problem = traced.problem
    # Block 0's output is an input of the second graph, and annotate counts graph inputs as
    # alive anyway (0 bytes): the 128-byte residual at the break is not charged to anyone.
    assert problem.keep_all_bytes() == 768 - 128
    assert {v.name.split(".")[0] for v in problem.values} == {"g0", "g1"}
    rows = _numbers(solvers.solve(problem, None, solver="keep_all").per_module(depth=2))
    assert rows == {"blocks.0": ("none", 256, 0, 256, 0), "blocks.1": ("none", 384, 0, 384, 0),
                    "head": ("none", 0, 0, 0, 0)}
    assert explain_traced(traced, 0.5).plan.kept_bytes <= 384
