"""Small exact integer programs inside the fast planner: the polish of a whole plan, and sub-problems.

Both use exact bytes and the plain recompute-time objective (``_model.time_weights``), so a
bound converts back to seconds; both go through ``_run.solve_once`` like every ILP run.
"""

from __future__ import annotations

import logging

from .._mip import resolve_backend
from .._model import rounding_for, time_weights
from .._run import solve_once
from ..errors import SolverError
from ..problem import Plan, Problem
from ..registry import keep_all_decision
from .network import DOWN

logger = logging.getLogger(__name__)


def polish(problem: Problem, budget: int, plan: Plan, time_limit: float, backend: str,
           threads: int | None) -> tuple[Plan, float | None]:
    """Run the ILP (exact bytes) from ``plan`` for at most ``time_limit``; (best plan, proven bound in seconds)."""
    # Exact bytes (no coarser unit): a proof of this model is a proof for the real budget. No
    # tie-break terms: the objective is recompute seconds over `unit`, so its bound converts back.
    weights, unit = time_weights(problem)
    outcome = solve_once(problem, budget, rounding=rounding_for(problem, exact=True), weights=weights, start=plan,
                         time_limit=time_limit, backend=resolve_backend(backend), threads=threads)
    best = plan
    # Only the bound counts as proof: the model's optimum can miss the real budget by a few bytes
    # (integrality tolerance times large byte coefficients), and is then not taken.
    if outcome.plan is not None and outcome.fits and outcome.plan.recompute_seconds < plan.recompute_seconds:
        best = outcome.plan
    bound = outcome.bound * unit * DOWN if outcome.bound is not None else None
    logger.debug("fast: ILP polish %s in %.2fs (bound %s)", outcome.status, outcome.result.seconds, bound)
    return best, bound


def exact_keep(problem: Problem, budget: int, time_limit: float, backend: str,
               threads: int | None) -> frozenset[int] | None:
    """The keep set of an optimal plan for a small problem (None: infeasible or not found in time).

    The ILP model with exact bytes and the plain recompute-time objective, one backend run; the
    caller evaluates what it returns, so neither a proof nor ``solve_ilp``'s extra runs are needed.
    """
    if budget >= problem.keep_all_bytes():
        return keep_all_decision(problem).kept
    try:
        outcome = solve_once(problem, budget, rounding=rounding_for(problem, exact=True),
                             weights=time_weights(problem)[0], time_limit=time_limit,
                             backend=resolve_backend(backend), threads=threads)
    except SolverError:
        return None
    return outcome.plan.kept if outcome.plan is not None and outcome.fits else None
