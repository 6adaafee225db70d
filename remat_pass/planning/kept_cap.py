"""A peak-budget plan that also keeps at most a number of bytes for backward.

A piece of a step split at graph breaks keeps its saved tensors through every later piece's
forward and backward, so besides its own peak it must leave the later pieces room for theirs
(``runtime.earlier_pieces``): ``PlanOptions.kept_cap_bytes``. The peak planners bound one
quantity; the other is met from outside. A plan over the cap is planned again at a peak budget
lowered by its excess (lowering the peak by some bytes lowers what can be kept by about as
many), a few times and never below the lowest peak a refusal found; then the least recompute that
keeps within the cap (the cap as a budget of saved bytes), if its predicted peak fits; else the cap
itself as the peak budget, which bounds what is kept too (every kept value is alive when backward
begins, so it counts in the peak). Each try is one more plan of the piece, paid only where a later
piece's needs were learnt (``earlier_pieces``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from remat_pass import solvers

from .budget import Budget

if TYPE_CHECKING:  # the pipeline imports this module
    from .pipeline import PlanOptions, Planned, ResolvedBudget

logger = logging.getLogger(__name__)

TRIES = 3
"""Plans at lowered peak budgets before the cap itself is the peak budget."""


def keeping_at_most(options: PlanOptions, planned: Planned, plan_at: Callable[[PlanOptions], Planned]) -> Planned:
    """``planned`` if it keeps at most ``options.kept_cap_bytes``, else a plan that does, made by
    ``plan_at`` (the pipeline's ``plan_problem`` of the same problem) at lowered peak budgets, never
    below the lowest peak a refusal found. The result is reported against the budget first asked
    (``planned.budget``); where none keeps within the cap, the refusal of the cap as peak budget."""
    cap = options.kept_cap_bytes
    if cap is None or planned.plan.kept_bytes <= cap:
        return planned
    asked, budget, floor = planned.budget, planned.budget.budget_bytes, 0
    for _ in range(TRIES):
        budget = max(budget - (planned.plan.kept_bytes - cap), floor)
        if budget <= cap:
            break
        logger.info("the plan keeps %d bytes, over the %d the later pieces leave: planned again at a peak budget of "
                    "%d bytes", planned.plan.kept_bytes, cap, budget)
        try:
            planned = plan_at(_lowered(options, budget))
        except solvers.BudgetInfeasibleError as error:
            if floor:
                break
            floor = budget = error.min_bytes  # the next try plans at the lowest peak found
            continue
        if planned.plan.kept_bytes <= cap:
            return _as_asked(planned, asked)
    try:
        keeping = plan_at(replace(options, budget=Budget(nbytes=cap), budget_kind=solvers.BudgetKind.SAVED,
                                  kept_cap_bytes=None))
    except solvers.BudgetInfeasibleError:
        keeping = None
    if keeping is not None and _peaks_within(keeping, asked):
        return _as_asked(keeping, asked)
    logger.info("planned at a peak budget of %d bytes, what the later pieces leave to keep", cap)
    return _as_asked(plan_at(_lowered(options, cap)), asked)


def _peaks_within(planned: Planned, asked: ResolvedBudget) -> bool:
    """Whether a plan made under the cap as a budget of saved bytes (the least recompute that keeps
    within it) is predicted to peak within the peak budget asked (less the headroom, as planned)."""
    peak = planned.plan.predicted_peak_bytes
    return peak is not None and peak <= asked.target_bytes


def _lowered(options: PlanOptions, budget_bytes: int) -> PlanOptions:
    return replace(options, budget=Budget(nbytes=budget_bytes), kept_cap_bytes=None)


def _as_asked(planned: Planned, asked: ResolvedBudget) -> Planned:
    plan = replace(planned.plan, budget_bytes=asked.budget_bytes, budget_kind=asked.kind)
    return replace(planned, plan=plan, budget=asked)
