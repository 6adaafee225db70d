"""The fast planner's cascade: hull search, block mixes, then an ILP polish or bucket refinement.

Each step only runs while the gap to the proven Lagrangian bound is open and time is left; the
status is "optimal" only when that gap is closed (by the bound or an ILP proof).
"""

from __future__ import annotations

import logging
import math

from .. import clock
from ..errors import BudgetInfeasibleError
from ..ilp import min_feasible_bytes, solve_ilp
from ..problem import Plan, Problem
from ..registry import Decision, planner
from ..status import CLOSED_GAP, DEFAULT_TIME_LIMIT, BudgetKind, Status, relative_gap
from .blocks import decompose
from .hull import HullSearch, extreme_multipliers, mixes
from .oracle import Oracle, Point
from .polish import polish as ilp_polish
from .refine import refine as refine_buckets

logger = logging.getLogger(__name__)

DEFAULT_POLISH_TIME_LIMIT = 3.0
DEFAULT_REFINE_TIME_LIMIT = 10.0
# The ILP polish is skipped above this many relevant values (the model alone takes seconds to build).
DEFAULT_POLISH_MAX_VALUES = 5000


@planner("fast", description="Lagrangian minimum cuts shared across identical blocks, then a short ILP; "
         "scales to deep models, with an honest gap", exact=False, bounds=BudgetKind.SAVED)
def solve_fast(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    blocks: bool = True,
    refine: bool = True,
    refine_time_limit: float = DEFAULT_REFINE_TIME_LIMIT,
    polish: bool | None = None,
    polish_time_limit: float = DEFAULT_POLISH_TIME_LIMIT,
    polish_max_values: int = DEFAULT_POLISH_MAX_VALUES,
    gap_target: float = CLOSED_GAP,
    backend: str = "auto",
    threads: int | None = None,
) -> Decision:
    """The least recompute time keeping at most ``budget_bytes``, fast on deep models.

    Lagrangian min-cuts (shared across identical ``blocks``) give the hull of the trade-off and a
    proven lower bound; plans between the two hull points around the budget mix the blocks'
    answers. Then, unless the gap is within ``gap_target`` already: an ILP warm-started from the
    best plan runs for ``polish_time_limit`` seconds (``polish``: None = only for problems of at
    most ``polish_max_values`` relevant values, True = always, False = never), and if that did
    not prove it, ``refine`` improves the plan one bucket of identical groups at a time (exact
    sub-problems, the budget split across the bucket) for at most ``refine_time_limit`` seconds.
    ``time_limit`` bounds the whole call (seconds). The status is "optimal" only when the gap is
    closed (by the bound or an ILP proof); otherwise "feasible" with the gap to the best proven
    lower bound. Raises BudgetInfeasibleError below the smallest feasible budget, like "ilp";
    ``backend`` and ``threads`` go to the ILP runs.

    >>> from remat_pass.solvers.problem import Problem, Value
    >>> x = Value(0, "x", (), storage=0, available=True)
    >>> h = Value(1, "h", (0,), storage=1, recompute_seconds=1e-3)
    >>> y = Value(2, "y", (1,), storage=2, recompute_seconds=2e-3)
    >>> plan = solve_fast(Problem((x, h, y), (0, 100, 100), frozenset({1, 2})), budget_bytes=100)
    >>> sorted(plan.recomputed), plan.status.value
    ([1], 'optimal')
    """
    began = clock.now()
    deadline = began + time_limit
    oracle = Oracle(problem, decompose(problem, blocks=blocks))
    search = HullSearch(oracle, deadline)
    low_lam, high_lam = extreme_multipliers(oracle)
    low = search.at(low_lam)
    if low.nbytes <= budget_bytes:
        # The least recompute time of all fits. Proven by the cost-only cut (multiplier 0), which
        # bounds every budget, unless rounding hid a cost difference.
        search.at(0.0)
        return _closed_or_not(low, search.lower_bound(budget_bytes))
    high = search.at(high_lam)
    if high.nbytes > budget_bytes:
        return _below_the_cuts(problem, budget_bytes, oracle, high, deadline, backend, threads)
    low, high = search.bracket(low, high, budget_bytes)
    candidates = [high, *mixes(oracle, low, high, budget_bytes)]
    best = min((c for c in candidates if c.nbytes <= budget_bytes), key=lambda c: (c.seconds, c.nbytes))
    lower = search.lower_bound(budget_bytes)
    plan = _plan_of(problem, best)
    gap = relative_gap(plan.recompute_seconds, lower)
    proven = False
    # Small problems: the whole ILP from the best plan is quick and may prove it. Deep ones: refine
    # bucket by bucket (small exact sub-problems with the budget split across identical blocks).
    if polish if polish is not None else len(oracle.relevant) <= polish_max_values:
        left = deadline - clock.now()
        if gap > gap_target and left > 0.05:
            plan, ilp_bound = ilp_polish(problem, budget_bytes, plan, min(polish_time_limit, left), backend, threads)
            if ilp_bound is not None:
                lower = max(lower, ilp_bound)
            gap = relative_gap(plan.recompute_seconds, lower)
            proven = gap <= CLOSED_GAP
    if refine and not proven and gap > gap_target and deadline - clock.now() > 0.05:
        kept = refine_buckets(oracle, plan.kept, budget_bytes, min(deadline, clock.now() + refine_time_limit),
                              max_values=polish_max_values, backend=backend, threads=threads)
        refined = oracle.point(0.0, (kept,), -math.inf)
        if refined.seconds < plan.recompute_seconds:
            plan = _plan_of(problem, refined)
            gap = relative_gap(plan.recompute_seconds, lower)
    status = Status.OPTIMAL if proven or gap <= CLOSED_GAP else Status.FEASIBLE
    if status is Status.FEASIBLE and clock.now() >= deadline:
        status = Status.TIME_LIMIT
    logger.info("fast: %d groups, %d classes, %d cuts, %d hull points; budget %d B, kept %d B, recompute %.6g s, "
                "%s, gap %.3g, %.3fs", len(oracle.split.groups), len(oracle.split.classes), oracle.cuts,
                len(search.points), budget_bytes, plan.kept_bytes, plan.recompute_seconds, status, gap,
                clock.now() - began)
    return Decision.of(plan, status, 0.0 if status is Status.OPTIMAL else gap)


def _closed_or_not(point: Point, lower: float) -> Decision:
    gap = relative_gap(point.seconds, lower)
    if gap <= CLOSED_GAP:
        return Decision(point.kept, point.recomputed, Status.OPTIMAL, 0.0)
    return Decision(point.kept, point.recomputed, Status.FEASIBLE, gap)


def _below_the_cuts(problem: Problem, budget: int, oracle: Oracle, fewest: Point, deadline: float, backend: str,
                    threads: int | None) -> Decision:
    """No cut fits the budget: infeasible, unless the inexact min-cut model missed a plan (then the ILP's)."""
    smallest = fewest.nbytes if oracle.exact else min_feasible_bytes(
        problem, time_limit=max(deadline - clock.now(), 10.0), backend=backend, threads=threads)
    if smallest > budget:
        raise BudgetInfeasibleError(budget, smallest, problem.keep_all_bytes())
    logger.info("fast: the inexact min-cut model missed a plan the ILP finds; using the ILP")
    plan = solve_ilp(problem, budget, time_limit=max(deadline - clock.now(), 1.0), backend=backend,
                     threads=threads)
    return Decision.of(plan, plan.status, plan.gap)


def _plan_of(problem: Problem, point: Point) -> Plan:
    return Plan(problem=problem, kept=point.kept, recomputed=point.recomputed, solver="fast", status="feasible",
                gap=None)
