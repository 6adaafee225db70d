"""Explain a plan without training: trace the step once, solve one budget, and say per module
what is kept, what is recomputed and what that costs.

>>> import torch, remat_pass.tools.explain as rx
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
>>> explanation = rx.explain(model, (torch.randn(4, 8),), budget=0.5)
>>> explanation.plan.kept_bytes <= explanation.plan.keep_all_bytes // 2
True
>>> [row.module for row in explanation.rows]
['0', '1', '2']
>>> explanation.show()  # doctest: +SKIP

The step is traced by ``pipeline.trace_step`` (capture, annotate, one torch-free ``Problem`` for the
whole step, with its forward+backward FLOPs to put recompute in proportion; a stack of 7 or more
identical blocks traced 4 blocks deep and stamped, ``planning.repeated_blocks``) and planned by
``pipeline.plan_problem``, as ``sweep`` and ``plan`` do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..planning.budget import parse_budget
from ..annotate.costs import CostModel, DeviceProfile, parse_costs
from ..planning.effort import planning_effort
from ..planning.pipeline import BudgetKind, LossFn, PlanOptions, TracedStep, plan_problem
from ..planning.repeated_blocks import trace_repeated
from ..planning.trace_key import before_tracing
from ..capture.inputs import call_inputs
from ..runtime.plan_cache import as_plan_cache
from ..capture.loss_chunking import ChunkLoss
from ..planning.loss_choice import Pin
from ..planning.plan_model import plan_or_chunk
from .report import PlanReport

Explanation = PlanReport
"""What ``explain`` returns: the one plan report (``remat_pass.tools.report.PlanReport``)."""


def explain_traced(
    traced: TracedStep,
    budget: object,
    solver: str = "ilp",
    *,
    depth: int | None = None,
    budget_kind: str = BudgetKind.AUTO,
    offload: bool = False,
    **solver_options: Any,
) -> PlanReport:
    """``explain`` for a step already traced (``trace_step``); raises BudgetInfeasibleError.

    The budget means what it means for ``optimize`` (``budget_kind``: a fraction bounds saved
    bytes, an absolute size the step's peak, unless told otherwise). ``time_limit`` and ``prove``
    (in ``solver_options``) as for ``optimize``: by default 2 s and no proof work; ``plan_cache``
    too (by default ``~/.cache/remat_pass/plans``; ``False`` for none).
    """
    parsed = parse_budget(budget)
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be a positive number of path parts or None, got {depth}")
    time_limit, prove = planning_effort(solver_options.pop("time_limit", None), solver_options.pop("prove", None))
    cache = as_plan_cache(solver_options.pop("plan_cache", True))
    options = PlanOptions(parsed, solver, traced.problem.device, time_limit, budget_kind, solver_options,
                          offload=offload, prove=prove, plan_cache=cache)
    plan = plan_problem(traced.problem, options).plan
    return PlanReport(plan, traced.step_flops, traced.forward_seconds, traced.pieces, budget=parsed, depth=depth)


def explain(
    model: nn.Module,
    example_inputs: Any,
    budget: object,
    solver: str = "ilp",
    device: str | DeviceProfile = "auto",
    *,
    loss_fn: LossFn | None = None,
    depth: int | None = None,
    costs: str = CostModel.ROOFLINE,
    chunk_loss: Any = None,
    pretrace_key: bool = True,
    **solver_options: Any,
) -> PlanReport:
    """Plan ``model``'s training step for ``budget`` and account for it module by module.

    Nothing is trained: the step is traced once (see ``trace_step``). ``budget`` as for
    ``optimize``; an impossible one raises BudgetInfeasibleError with the smallest feasible.
    ``solver`` is any name in ``solvers.SOLVERS``; ``device`` picks the cost model and ``costs``
    how it prices recompute ("roofline", "flops", "measure"). ``chunk_loss`` as for ``optimize``
    (by default the loss is chunked where the budget cannot be met whole, or is met whole only with
    more work; the report's note then says so, with what it saved). A repeated call is answered
    from the plan cache before tracing unless ``pretrace_key=False`` (``plan``'s option;
    ``planning.trace_key`` says what that key cannot see).
    """
    arguments = {"budget": parse_budget(budget), "solver": solver, "device": device, "loss_fn": loss_fn,
                 "depth": depth, "costs": costs, "chunk_loss": chunk_loss,
                 "solver_options": {k: v for k, v in solver_options.items() if k != "plan_cache"}}
    cache = as_plan_cache(solver_options.get("plan_cache", True)) if pretrace_key else None
    return before_tracing("explain", model, call_inputs(example_inputs), arguments, cache, lambda: explain_step(
        model, example_inputs, budget, solver, device, loss_fn=loss_fn, depth=depth, costs=costs,
        chunk_loss=chunk_loss, **solver_options)[1])


def explain_step(
    model: nn.Module,
    example_inputs: Any,
    budget: object,
    solver: str = "ilp",
    device: str | DeviceProfile = "auto",
    *,
    loss_fn: LossFn | None = None,
    depth: int | None = None,
    costs: str = CostModel.ROOFLINE,
    chunk_loss: Any = None,
    **solver_options: Any,
) -> tuple[TracedStep, PlanReport]:
    """``explain``, and the traced step its report is of (the loss chunked or not: the command
    line plots from it)."""
    costs = parse_costs(costs)

    def trace(chunking: ChunkLoss | None) -> TracedStep:
        # A stack of identical blocks is traced 4 blocks deep and stamped (planning.repeated_blocks).
        return trace_repeated(model, example_inputs, loss_fn=loss_fn, device=device, costs=costs, chunk_loss=chunking)

    def report(traced: TracedStep, pin: Pin | None) -> PlanReport:
        if pin is None:
            return explain_traced(traced, budget, solver, depth=depth, **dict(solver_options))
        return explain_traced(traced, pin.budget_bytes, solver, depth=depth, **{**solver_options, "budget_kind": pin.kind})

    return plan_or_chunk(trace, chunk_loss, report, lambda made: made.plan)
