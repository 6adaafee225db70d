"""The exact planner: the keep/recompute integer program (``_model``) solved with PuLP.

The objective is the recompute time plus a tie-break far below the smallest cost that prefers
fewer kept bytes, then fewer recomputes, so equal-cost plans come out the same way every time.

Bytes are rounded conservatively (storages up, the budget down) so a plan that fits the model
fits the real budget; ``Plan.kept_bytes`` is checked exactly afterwards. When the rounding is
lossy, the same model rounded the other way is a relaxation: solving it proves (or bounds)
optimality for the real budget and sometimes finds a better plan that still fits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from . import baselines
from ._mip import MipResult, resolve_backend
from ._model import Rounding, Weights, rounding_for, weights_for
from ._run import Outcome, solve_once
from .errors import BudgetInfeasibleError, SolverError
from .problem import Plan, Problem
from .registry import Decision, planner
from .status import CLOSED_GAP, DEFAULT_TIME_LIMIT, BudgetKind, Status, relative_gap

logger = logging.getLogger(__name__)


def _min_bytes_plan(problem: Problem, backend: str, time_limit: float, threads: int | None) -> Plan:
    """A plan keeping the fewest bytes possible, proven optimal (storages counted once)."""
    began = time.perf_counter()
    fallback = baselines.recompute_all(problem)
    if fallback.kept_bytes == 0:
        return Plan(problem=problem, kept=fallback.kept, recomputed=fallback.recomputed, solver="ilp-min-bytes",
                    solve_seconds=time.perf_counter() - began)
    # The objective is a whole number of units: an absolute gap under one proves the exact minimum,
    # where a relative one would let a big total stop some units short.
    outcome = solve_once(problem, None, rounding=rounding_for(problem, exact=True), weights=None,
                         time_limit=time_limit, backend=backend, threads=threads, start=fallback, gaps=(0.0, 0.5))
    if outcome.status != "optimal" or outcome.plan is None:
        raise SolverError(
            f"could not prove the smallest feasible budget within time_limit={time_limit:g}s "
            f"({outcome.status}); pass a larger time_limit"
        )
    plan = Plan(problem=problem, kept=outcome.plan.kept, recomputed=outcome.plan.recomputed, solver="ilp-min-bytes",
                solve_seconds=time.perf_counter() - began)
    logger.debug("ilp: smallest feasible budget %d bytes (%.3fs)", plan.kept_bytes, plan.solve_seconds)
    return plan


def min_feasible_bytes(problem: Problem, *, time_limit: float = DEFAULT_TIME_LIMIT, backend: str = "auto",
                       threads: int | None = None) -> int:
    """The fewest bytes any valid plan keeps: no smaller budget can be met.

    Exact, including storages shared by several values: an ILP over the same rows as the
    planner, minimizing unrounded bytes, proven optimal (SolverError if not proven in time).

    >>> from remat_pass.solvers.problem import Problem, Value
    >>> x = Value(0, "x", (), storage=0, available=True)
    >>> y = Value(1, "y", (0,), storage=1, recomputable=False)  # e.g. dropout
    >>> min_feasible_bytes(Problem((x, y), (0, 64), frozenset({1})))
    64
    """
    engine = resolve_backend(backend)
    return _min_bytes_plan(problem, engine, time_limit, threads).kept_bytes


def _warm_plan(problem: Problem, budget_bytes: int, backend: str, deadline: float, threads: int | None) -> Plan:
    """The cheapest heuristic plan within budget; else the min-bytes plan; else BudgetInfeasibleError."""
    fitting = [p for p in baselines.heuristic_plans(problem) if p.kept_bytes <= budget_bytes]
    if fitting:
        return min(fitting, key=lambda p: (p.recompute_seconds, p.kept_bytes, p.solver))
    smallest = _min_bytes_plan(problem, backend, _remaining(deadline), threads)
    if smallest.kept_bytes > budget_bytes:
        raise BudgetInfeasibleError(budget_bytes, smallest.kept_bytes, problem.keep_all_bytes())
    return smallest


def _remaining(deadline: float) -> float:
    """Time left for the next backend run; never so little that a run cannot start."""
    return max(deadline - time.perf_counter(), 0.05)


@planner("ilp", description="exact integer program over keep/recompute (PuLP + HiGHS or CBC)", exact=True,
         bounds=BudgetKind.SAVED)
def solve_ilp(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    backend: str = "auto",
    threads: int | None = None,
) -> Decision:
    """The least recompute time that keeps at most ``budget_bytes`` (None: unlimited).

    Options: ``time_limit`` (seconds, for all backend runs of this call together),
    ``backend`` ("auto": HiGHS if it works, else PuLP's bundled CBC; "highs"; "cbc"),
    ``threads`` (the backend's default if None). Raises BudgetInfeasibleError below the
    smallest feasible budget, SolverError when the time limit passes before any plan is
    found, SolverUnavailableError when no backend works.

    >>> from remat_pass.solvers.problem import Problem, Value
    >>> x = Value(0, "x", (), storage=0, available=True)
    >>> h = Value(1, "h", (0,), storage=1, recompute_seconds=1e-3)
    >>> y = Value(2, "y", (1,), storage=2, recompute_seconds=2e-3)
    >>> plan = solve_ilp(Problem((x, h, y), (0, 100, 100), frozenset({1, 2})), budget_bytes=100)
    >>> sorted(plan.kept), sorted(plan.recomputed), plan.status.value
    ([2], [1], 'optimal')
    """
    began = time.perf_counter()
    context = _Context(problem, budget_bytes, resolve_backend(backend), began + time_limit, time_limit, threads)
    warm = _warm_plan(problem, budget_bytes, context.backend, context.deadline, threads)
    weights = weights_for(problem)
    rounding = rounding_for(problem)
    plan, result = _solve_rounded(context, rounding, weights, warm)
    if result.status == "infeasible" and not rounding.exact:
        logger.info("ilp: %d-byte units made budget %d infeasible; solving unrounded", rounding.quantum, budget_bytes)
        rounding = rounding_for(problem, exact=True)
        plan, result = _solve_rounded(context, rounding, weights, warm)
    assert plan is not None
    plan, status, gap = _prove(context, plan, result, rounding, weights)
    logger.info("ilp (%s): budget %d B, kept %d B, recompute %.6g s, %s, gap %s, %.3fs", context.backend,
                budget_bytes, plan.kept_bytes, plan.recompute_seconds, status, gap, time.perf_counter() - began)
    return Decision.of(plan, status, gap)
@dataclass(frozen=True)
class _Context:
    """What every backend run of one ``solve_ilp`` call shares."""

    problem: Problem
    budget_bytes: int
    backend: str
    deadline: float
    time_limit: float
    threads: int | None


def _solve_rounded(context: _Context, rounding: Rounding, weights: Weights, warm: Plan) -> tuple[Plan | None, MipResult]:
    """Solve one rounding of the model; a plan unless the model is infeasible; SolverError if none in time."""
    problem, budget_bytes = context.problem, context.budget_bytes
    logger.debug("ilp: %d-byte units rounded %s; warm start %s", rounding.quantum, "up" if rounding.up else "down",
                 warm.solver)
    outcome = solve_once(problem, budget_bytes, rounding=rounding, weights=weights, start=warm,
                         time_limit=_remaining(context.deadline), backend=context.backend, threads=context.threads)
    if outcome.status == "no_solution":
        raise SolverError(
            f"the {context.backend} backend found no plan for budget {budget_bytes} bytes within "
            f"time_limit={context.time_limit:g}s; pass a larger time_limit"
        )
    if outcome.status == "infeasible":
        if rounding.up and not rounding.exact:
            return None, outcome.result
        raise SolverError(f"the {context.backend} backend calls budget {budget_bytes} infeasible although "
                          f"{warm.solver} keeps {warm.kept_bytes} bytes within it; numerical trouble")
    return outcome.plan, outcome.result


def _prove(context: _Context, plan: Plan, result: MipResult, rounding: Rounding,
           weights: Weights) -> tuple[Plan, Status, float | None]:
    """"optimal" only when proven for the real budget; else "feasible" and the gap to a proven bound.

    With exact rounding the backend's word is the proof. With lossy rounding the model is
    stricter than the budget: the model rounded the other way is a relaxation and gives the
    bound; if that leaves a gap, the unrounded model (bigger coefficients) settles it.
    Either may find a better plan that fits the real budget, which is then taken.
    """
    if rounding.exact:
        if result.status == "optimal":
            return plan, Status.OPTIMAL, 0.0
        bound = result.bound if result.bound is not None else _lp_bound(context, rounding, weights)
        return plan, Status.FEASIBLE, relative_gap(weights.evaluate(plan), bound)
    bound: float | None = None
    for other in (rounding.optimistic(), rounding_for(context.problem, exact=True)):
        plan, outcome = _improve(context, other, weights, plan)
        if outcome.status == "optimal" and other.exact:
            return plan, Status.OPTIMAL, 0.0
        if outcome.bound is not None:
            bound = outcome.bound if bound is None else max(bound, outcome.bound)
        gap = relative_gap(weights.evaluate(plan), bound)
        if gap is not None and gap <= CLOSED_GAP:
            return plan, Status.OPTIMAL, 0.0
    if bound is None:
        bound = _lp_bound(context, rounding.optimistic(), weights)
    return plan, Status.FEASIBLE, relative_gap(weights.evaluate(plan), bound)


def _improve(context: _Context, rounding: Rounding, weights: Weights, plan: Plan) -> tuple[Plan, Outcome]:
    """Solve another rounding from ``plan``; keep its answer if it fits the real budget and is better."""
    outcome = _try_run(context, rounding, weights, start=plan)
    if outcome.plan is not None and outcome.fits and weights.evaluate(outcome.plan) < weights.evaluate(plan):
        plan = outcome.plan
    logger.debug("ilp: %d-byte units rounded %s: %s, bound %s", rounding.quantum,
                 "exactly" if rounding.exact else ("up" if rounding.up else "down"), outcome.status, outcome.bound)
    return plan, outcome


def _lp_bound(context: _Context, rounding: Rounding, weights: Weights) -> float | None:
    """The LP relaxation's optimum: a weak but honest bound when the backend reports none."""
    outcome = _try_run(context, rounding, weights, mip=False)
    return outcome.result.objective if outcome.status == "optimal" else None


def _try_run(context: _Context, rounding: Rounding, weights: Weights, **options: object) -> Outcome:
    """A run that only sharpens the answer: a crash costs the bound, not the plan already found."""
    try:
        return solve_once(context.problem, context.budget_bytes, rounding=rounding, weights=weights,
                          time_limit=_remaining(context.deadline), backend=context.backend, threads=context.threads,
                          **options)
    except SolverError as error:
        logger.warning("ilp: a bounding run failed, the gap may be unknown: %s", error)
        return Outcome(MipResult(status="no_solution", backend=context.backend))
