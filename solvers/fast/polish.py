"""Small exact integer programs inside the fast planner: the polish of a whole plan, and sub-problems.

Both use the plain recompute-time objective (``mip.keep_model.time_weights``), so a bound converts back to
seconds, and well-scaled units; both go through ``mip.run_keep.solve_once`` like every ILP run.
"""

from __future__ import annotations

import logging

from .. import clock
from ..mip.min_cut import DOWN
from ..mip.solve import resolve_backend
from ..mip.keep_model import rounding_for, time_weights
from ..mip.run_keep import solve_once
from ..errors import SolverError
from ..problem import Plan, Problem
from ..registry import keep_all_decision

logger = logging.getLogger(__name__)


def polish(problem: Problem, budget: int, plan: Plan, time_limit: float, backend: str,
           threads: int | None) -> tuple[Plan, float | None]:
    """Run the ILP from ``plan`` for at most ``time_limit``; (best plan, proven bound in seconds).

    In the planner's well-scaled units: conservative for plans that surely fit, and when those
    units are lossy, optimistic for the bound (a relaxation of the real budget). A bound comes
    only from a run ``solve_once`` believes.
    """
    weights, unit = time_weights(problem)
    engine = resolve_backend(backend)
    deadline = clock.now() + time_limit
    rounding = rounding_for(problem)
    best, bound = plan, None
    for model_rounding in (rounding,) if rounding.exact else (rounding, rounding.optimistic()):
        left = deadline - clock.now()
        if left <= 0.05:
            break
        outcome = solve_once(problem, budget, rounding=model_rounding, weights=weights, start=best,
                             time_limit=left, backend=engine, threads=threads)
        if outcome.plan is not None and outcome.fits and outcome.plan.recompute_seconds < best.recompute_seconds:
            best = outcome.plan
        if (model_rounding.exact or not model_rounding.up) and outcome.bound is not None:
            bound = max(bound or 0.0, outcome.bound * unit * DOWN)
        logger.debug("fast: ILP polish (%d-byte units) %s in %.2fs (bound %s)", model_rounding.quantum,
                     outcome.status, outcome.result.seconds, bound)
    return best, bound


def exact_keep(problem: Problem, budget: int, time_limit: float, backend: str,
               threads: int | None) -> frozenset[int] | None:
    """The keep set of an optimal plan for a small problem (None: infeasible or not found in time).

    The ILP model in well-scaled conservative units (whatever it returns fits) and the plain
    recompute-time objective, one backend run; the caller evaluates what it returns, so neither a
    proof nor ``solve_ilp``'s extra runs are needed.
    """
    if budget >= problem.keep_all_bytes():
        return keep_all_decision(problem).kept
    try:
        outcome = solve_once(problem, budget, rounding=rounding_for(problem),
                             weights=time_weights(problem)[0], time_limit=time_limit,
                             backend=resolve_backend(backend), threads=threads)
    except SolverError:
        return None
    return outcome.plan.kept if outcome.plan is not None and outcome.fits else None
