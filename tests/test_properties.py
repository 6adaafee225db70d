"""Property tests: random DAG-shaped modules at random budgets, through ``optimize``, against eager.

A drawn spec builds an ``nn.Module`` whose forward is a small DAG: linear layers, activations
(gelu, tanh, relu, sigmoid), LayerNorm, dropout, residual adds, products, concatenations, slices
(views that share an activation's storage) and in-place activations, each reading any earlier
node. Every sink feeds the output, so nothing is dead code. At a drawn
budget (a fraction, or bytes saved for backward) the step must give eager's loss and gradients
and save exactly the predicted bytes, within the budget; or the budget is infeasible and the
smallest budget the error states is itself feasible (and met exactly). Under bf16 autocast the
step is bit-identical to the same graph without remat. And beyond what solvers choose: every
valid plan (a random keep set completed into a plan, with needless extras) gives eager's step.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import remat_pass
from remat_pass import solvers
from remat_pass import BudgetInfeasibleError
from remat_pass.solvers.problem import Plan, closure_from_keep_set

from .helpers import assert_same_step, eager_reference, run_step
from .models import make_case

ACTIVATIONS = {"gelu": F.gelu, "tanh": torch.tanh, "relu": F.relu, "sigmoid": torch.sigmoid}
MAX_WIDTH = 24
FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THOROUGH = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Op:
    kind: str  # linear, act, norm, dropout, add, mul, cat, slice, inplace
    sources: tuple[int, ...]  # indices of earlier nodes; node 0 is the input
    width: int  # of this node's output
    detail: object = None  # activation name, dropout probability, linear bias


@st.composite
def dag_specs(draw: st.DrawFn) -> tuple[int, int, tuple[Op, ...]]:
    batch = draw(st.integers(1, 4))
    widths = [draw(st.integers(2, 12))]
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 7))):
        index = len(widths)
        source = draw(st.integers(0, index - 1))
        kind = draw(st.sampled_from(
            ["linear", "linear", "act", "act", "norm", "dropout", "add", "mul", "cat", "slice", "inplace"]
        ))
        width = widths[source]
        if kind == "slice":
            if width < 3:
                kind = "act"
            else:
                start = draw(st.integers(0, width - 2))
                stop = draw(st.integers(start + 1, width))
                ops.append(Op(kind, (source,), stop - start, (start, stop)))
                width = stop - start
        elif kind == "inplace":
            ops.append(Op(kind, (source,), width, draw(st.sampled_from(["relu_", "tanh_", "mul_"]))))
        elif kind in ("add", "mul"):
            partners = [i for i, w in enumerate(widths) if w == width and i != source]
            if not partners:
                kind = "act"
            else:
                ops.append(Op(kind, (source, draw(st.sampled_from(partners))), width))
        elif kind == "cat":
            other = draw(st.integers(0, index - 1))
            if width + widths[other] > MAX_WIDTH:
                kind = "linear"
            else:
                width += widths[other]
                ops.append(Op(kind, (source, other), width))
        if kind == "linear":
            width = draw(st.integers(2, 12))
            ops.append(Op(kind, (source,), width, draw(st.booleans())))
        elif kind == "act":
            ops.append(Op(kind, (source,), width, draw(st.sampled_from(sorted(ACTIVATIONS)))))
        elif kind == "norm":
            ops.append(Op(kind, (source,), width))
        elif kind == "dropout":
            ops.append(Op(kind, (source,), width, draw(st.sampled_from([0.1, 0.5]))))
        widths.append(width)
    return batch, widths[0], tuple(ops)


class RandomDag(nn.Module):
    def __init__(self, in_width: int, ops: tuple[Op, ...]) -> None:
        super().__init__()
        self.ops = ops
        widths = [in_width] + [op.width for op in ops]
        self.layers = nn.ModuleDict()
        for index, op in enumerate(ops, start=1):
            if op.kind == "linear":
                self.layers[str(index)] = nn.Linear(widths[op.sources[0]], op.width, bias=op.detail)
            elif op.kind == "norm":
                self.layers[str(index)] = nn.LayerNorm(op.width)
        read = {source for op in ops for source in op.sources}
        self.sinks = [i for i in range(len(widths)) if i not in read and i > 0] or [0]
        self.heads = nn.ModuleList(nn.Linear(widths[i], 1) for i in self.sinks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for index, op in enumerate(self.ops, start=1):
            a = nodes[op.sources[0]]
            if op.kind in ("linear", "norm"):
                y = self.layers[str(index)](a)
            elif op.kind == "act":
                y = ACTIVATIONS[op.detail](a)
            elif op.kind == "dropout":
                y = F.dropout(a, op.detail, self.training)
            elif op.kind == "add":
                y = a + nodes[op.sources[1]]
            elif op.kind == "mul":
                y = a * nodes[op.sources[1]]
            elif op.kind == "slice":
                start, stop = op.detail
                y = a[:, start:stop]  # a view: keeping it keeps all of a's storage
            elif op.kind == "inplace":
                y = a + 1  # a fresh tensor to modify in place (functionalization removes the mutation)
                y = y.mul_(0.5) if op.detail == "mul_" else getattr(y, op.detail)()
            else:
                y = torch.cat([a, nodes[op.sources[1]]], dim=-1)
            nodes.append(y)
        return sum(head(nodes[i]) for head, i in zip(self.heads, self.sinks))


def _loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


budgets = st.one_of(
    st.floats(0.02, 1.0, allow_nan=False).map(lambda f: round(f, 3)),
    st.integers(1, 3000),  # bytes saved for backward; keep-all here is a few hundred to a few thousand
)


def _step(model, x, budget):
    # The unit says "bytes" for the ints up to 100, which read like percentages without one.
    spelled = f"{budget}B" if isinstance(budget, int) else budget
    optimized = remat_pass.optimize(model, budget=spelled, budget_kind="saved")
    return optimized, run_step(model, optimized, (x,), _loss)


def _check(spec, budget, input_requires_grad):
    torch._dynamo.reset()  # the conftest fixture resets per test function, not per example
    batch, width, ops = spec
    torch.manual_seed(0)
    model = RandomDag(width, ops).train()
    x = torch.randn(batch, width, requires_grad=input_requires_grad)
    expected = eager_reference(model, (x,), _loss)
    x.grad = None
    try:
        optimized, actual = _step(model, x, budget)
    except BudgetInfeasibleError as error:
        limit = budget * error.keep_all_bytes if isinstance(budget, float) else budget
        assert error.min_bytes > limit, "infeasible, yet the stated smallest budget fits"
        event("infeasible: retried at the stated smallest budget")
        torch._dynamo.reset()
        x.grad = None
        optimized, actual = _step(model, x, error.min_bytes)
        assert actual.saved_bytes == optimized.plan.kept_bytes == error.min_bytes
        assert_same_step(actual, expected)
        return
    plan = optimized.plan
    event("keeps all" if not plan.recomputed else "recomputes")
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    assert actual.saved_bytes == plan.kept_bytes
    limit = budget * plan.keep_all_bytes if isinstance(budget, float) else budget
    assert actual.saved_bytes <= limit
    if isinstance(budget, float) and budget == 1.0 or not isinstance(budget, float) and budget >= plan.keep_all_bytes:
        assert not plan.recomputed
    random_values = {v.id for v in plan.problem.values if "random" in v.tags}
    assert not random_values & plan.recomputed


@FAST
@given(spec=dag_specs(), budget=budgets, input_requires_grad=st.booleans())
def test_random_dags_match_eager_within_budget(spec, budget, input_requires_grad):
    _check(spec, budget, input_requires_grad)


@pytest.mark.slow
@THOROUGH
@given(spec=dag_specs(), budget=budgets, input_requires_grad=st.booleans())
def test_random_dags_match_eager_within_budget_thoroughly(spec, budget, input_requires_grad):
    _check(spec, budget, input_requires_grad)


def _check_autocast(spec, budget):
    """Under bf16 autocast: bit-identical to the same graph without remat (AOTAutograd's own,
    ``backend="aot_eager"``), and the saved bytes (bf16 and fp32 mixed) exactly as predicted."""
    torch._dynamo.reset()
    batch, width, ops = spec
    torch.manual_seed(0)
    model = RandomDag(width, ops).train()
    x = torch.randn(batch, width)

    def autocast(fn):
        def call(*inputs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*inputs)
        return call

    twin = copy.deepcopy(model)
    traced = run_step(twin, autocast(torch.compile(twin, backend="aot_eager")), (x,), _loss)
    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, budget=budget)
    try:
        actual = run_step(model, autocast(optimized), (x,), _loss)
    except BudgetInfeasibleError as error:
        assert error.min_bytes > budget * error.keep_all_bytes
        event("autocast: infeasible")
        return
    assert torch.equal(actual.loss, traced.loss)
    for name, grad in traced.grads.items():
        assert torch.equal(actual.grads[name], grad), name
    assert actual.saved_bytes == optimized.plan.kept_bytes <= budget * optimized.plan.keep_all_bytes


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=dag_specs(), budget=st.floats(0.05, 1.0).map(lambda f: round(f, 3)))
def test_random_dags_under_autocast_are_exact_and_counted(spec, budget):
    _check_autocast(spec, budget)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=dag_specs(), budget=st.floats(0.05, 1.0).map(lambda f: round(f, 3)))
def test_random_dags_under_autocast_are_exact_and_counted_thoroughly(spec, budget):
    _check_autocast(spec, budget)


# --- any valid plan, not only the ones a solver picks -------------------------------------------


@st.composite
def plan_choices(draw: st.DrawFn) -> tuple[float, str, int]:
    """How to draw a plan: the share of keepable values to keep, what to add, a seed."""
    return draw(st.floats(0.0, 1.0)), draw(st.sampled_from(["minimal", "extra_kept", "extra_recomputed"])), \
        draw(st.integers(0, 2**16))


def _random_planner(share: float, extra: str, seed: int):
    """A planner that ignores the budget: keeps a random set of values, completes it into a
    valid plan, then (maybe) keeps values backward never reads or recomputes values nobody needs."""
    def plan(problem, budget_bytes=None, **_options):
        rng = random.Random(seed)
        wanted = {v.id for v in problem.values if v.keepable and not v.available and rng.random() < share}
        kept, recomputed = (set(s) for s in closure_from_keep_set(problem, wanted))
        for value in problem.values:
            if value.available or value.id in kept or value.id in recomputed:
                continue
            inputs_had = all(problem.values[u].available or u in kept or u in recomputed for u in value.inputs)
            if extra == "extra_kept" and value.keepable and rng.random() < 0.2:
                kept.add(value.id)
            elif extra == "extra_recomputed" and inputs_had and value.recomputable and rng.random() < 0.3:
                recomputed.add(value.id)
        return Plan(problem=problem, kept=frozenset(kept), recomputed=frozenset(recomputed), solver="random",
                    budget_bytes=budget_bytes)

    return plan


def _check_any_plan(model, inputs, loss_fn, choice):
    share, extra, seed = choice
    torch._dynamo.reset()
    expected = eager_reference(model, inputs, loss_fn)
    info = solvers.SolverInfo("random_test", "a random valid plan", exact=False, bounds=None)
    with mock.patch.dict(solvers.SOLVERS, {"random_test": _random_planner(share, extra, seed)}), \
            mock.patch.dict(solvers.SOLVER_INFO, {"random_test": info}):
        # plan_cache=False: the planner under this name changes per example, which no cache key sees
        optimized = remat_pass.optimize(model, budget=1.0, solver="random_test", plan_cache=False)
        actual = run_step(model, optimized, inputs, loss_fn)
    event(extra)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    if extra == "extra_kept":  # values backward never reads are not really saved
        assert actual.saved_bytes <= optimized.plan.kept_bytes
    else:
        assert actual.saved_bytes == optimized.plan.kept_bytes
    values = optimized.plan.problem.values
    assert not any("random" in values[i].tags for i in optimized.plan.recomputed)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=dag_specs(), choice=plan_choices())
def test_every_valid_plan_gives_eager_gradients(spec, choice):
    batch, width, ops = spec
    torch.manual_seed(0)
    model = RandomDag(width, ops).train()
    _check_any_plan(model, (torch.randn(batch, width),), _loss, choice)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["mlp", "cnn", "gpt", "tied", "inplace"]), choice=plan_choices())
def test_every_valid_plan_gives_eager_gradients_on_the_small_models(name, choice):
    model, inputs, loss_fn = make_case(name)
    _check_any_plan(model, inputs, loss_fn, choice)
