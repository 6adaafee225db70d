"""The exact planner: the keep/recompute integer program (``mip.keep_model``) solved with PuLP.

The objective is the recompute time alone; among plans of the least time, a second run (the
tie-break, ``mip.keep_model.cap_time``) takes the one keeping the fewest bytes, then the fewest
recomputes, so equal-cost plans come out the same way every time and no byte more is kept than
an optimal plan needs.

What is claimed is only what is proven (issue 15). Every run goes through ``mip.run_keep.solve_once``,
which checks the backend's answer and believes a proof only from a well-scaled model. Bytes are
counted in units: the sizes' gcd when that needs few units (the model is then exact and its
proof is the proof), else a coarse unit. With a coarse unit, storages rounded up and the budget
down (conservative) give plans that surely fit; the same model rounded the other way
(optimistic) is a relaxation whose bound proves optimality for the real budget, and whose plan
is taken when it fits in exact integers; finer units follow while still well scaled. Last, the
split model (``Rounding.split``: a count of units plus each size's remainder) is exact to the
byte with coefficients no bigger than the unit, so it can certify what byte-sized coefficients
never could. A gap left open means "feasible" with that gap, or "time_limit" when the time
limit cut a run short.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import baselines, clock
from .mip.min_cut import min_bytes_cut
from .mip.solve import MipResult, resolve_backend
from .mip.keep_model import Rounding, Weights, finer_roundings, rounding_for, time_weights
from .mip.run_keep import Outcome, solve_once
from .errors import BudgetInfeasibleError, SolverError
from .problem import Plan, Problem, closure_from_keep_set
from .registry import Decision, planner
from .status import CLOSED_GAP, DEFAULT_TIME_LIMIT, BudgetKind, Status, relative_gap

logger = logging.getLogger(__name__)


def _min_bytes_plan(problem: Problem, backend: str, time_limit: float, threads: int | None) -> Plan:
    """A plan keeping the fewest bytes possible, proven (storages counted once); SolverError if not provable."""
    began = clock.now()
    fallback = baselines.recompute_all(problem)
    keep = frozenset() if fallback.kept_bytes == 0 else min_bytes_cut(problem)
    if keep is None:
        keep = _min_bytes_ilp(problem, fallback, backend, time_limit, threads)
    kept, recomputed = closure_from_keep_set(problem, keep)
    plan = Plan(problem=problem, kept=kept, recomputed=recomputed, solver="ilp-min-bytes",
                solve_seconds=clock.now() - began)
    logger.debug("ilp: smallest feasible budget %d bytes (%.3fs)", plan.kept_bytes, plan.solve_seconds)
    return plan


def _min_bytes_ilp(problem: Problem, fallback: Plan, backend: str, time_limit: float,
                   threads: int | None) -> frozenset[int]:
    """The min-bytes ILP in exact units, for problems the cut cannot model; only a certified answer counts."""
    # The objective is a whole number of units: an absolute gap under one proves the exact minimum,
    # where a relative one would let a big total stop some units short.
    rounding = rounding_for(problem, exact=True)
    outcome = solve_once(problem, None, rounding=rounding, weights=None, time_limit=time_limit, backend=backend,
                         threads=threads, start=fallback, gaps=(0.0, 0.5))
    if not outcome.certified or outcome.plan is None:
        why = ("its sizes need too many byte units for a proof to be believed" if not rounding.well_scaled
               else f"the {backend} backend ended {outcome.status}")
        raise SolverError(f"could not prove the smallest feasible budget within time_limit={time_limit:g}s: {why}; "
                          "pass a larger time_limit, or a budget that a heuristic plan meets")
    return outcome.plan.kept


def min_feasible_bytes(problem: Problem, *, time_limit: float = DEFAULT_TIME_LIMIT, backend: str = "auto",
                       threads: int | None = None) -> int:
    """The fewest bytes any valid plan keeps: no smaller budget can be met.

    Exact to the byte, storages shared by several values counted once: a minimum cut with free
    recomputes and byte capacities in Python integers (``mip.min_cut.min_bytes_cut``). When one storage
    is kept through two values (a mutated alias) the cut cannot model it; then an ILP over the
    planner's rows in exact units decides, and its answer counts only when proven on a
    well-scaled model (SolverError otherwise).

    >>> from remat_pass.solvers.problem import Problem, Value
    >>> x = Value(0, "x", (), storage=0, available=True)
    >>> y = Value(1, "y", (0,), storage=1, recomputable=False)  # e.g. dropout
    >>> min_feasible_bytes(Problem((x, y), (0, 64), frozenset({1})))
    64
    """
    return _min_bytes_plan(problem, resolve_backend(backend), time_limit, threads).kept_bytes


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
    return max(deadline - clock.now(), 0.05)


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
    smallest feasible budget, SolverUnavailableError when no backend works. The status is
    "optimal" only when proven; otherwise the best plan found (at worst the best checkpointing
    heuristic that fits) with its gap to a proven bound ("feasible", or "time_limit").

    >>> from remat_pass.solvers.problem import Problem, Value
    >>> x = Value(0, "x", (), storage=0, available=True)
    >>> h = Value(1, "h", (0,), storage=1, recompute_seconds=1e-3)
    >>> y = Value(2, "y", (1,), storage=2, recompute_seconds=2e-3)
    >>> plan = solve_ilp(Problem((x, h, y), (0, 100, 100), frozenset({1, 2})), budget_bytes=100)
    >>> sorted(plan.kept), sorted(plan.recomputed), plan.status.value
    ([2], [1], 'optimal')
    """
    began = clock.now()
    context = _Context(problem, budget_bytes, resolve_backend(backend), began + time_limit, time_limit, threads)
    proof = _Proof(context, _warm_plan(problem, budget_bytes, context.backend, context.deadline, threads))
    rounding = rounding_for(problem)
    proof.run(rounding)
    if not rounding.exact:
        proof.run(rounding.optimistic())
        for finer in finer_roundings(problem, rounding):  # finer units, still believed
            if proof.closed or clock.now() >= context.deadline:
                break
            proof.run(finer)
            if not finer.exact:
                proof.run(finer.optimistic())
        if not proof.closed and not rounding_for(problem, exact=True).well_scaled:
            proof.run(rounding.split_exact())  # exact to the byte in well-scaled coefficients
    if proof.bound is None:
        proof.lp_bound(rounding if rounding.exact else rounding.optimistic())
    status, gap = proof.verdict()
    plan = _fewest_bytes(context, proof.best, proof.weights) if status is Status.OPTIMAL else proof.best
    logger.info("ilp (%s): budget %d B, kept %d B, recompute %.6g s, %s, gap %s, %.3fs", context.backend,
                budget_bytes, plan.kept_bytes, plan.recompute_seconds, status, gap, clock.now() - began)
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


class _Proof:
    """The best plan within the real budget so far, and the best lower bound believed (time units)."""

    def __init__(self, context: _Context, warm: Plan) -> None:
        self.context = context
        self.weights, _ = time_weights(context.problem)
        self.best = warm
        self.bound: float | None = None
        self.stopped = False

    @property
    def closed(self) -> bool:
        gap = relative_gap(self.weights.evaluate(self.best), self.bound)
        return gap is not None and gap <= CLOSED_GAP

    def run(self, rounding: Rounding) -> None:
        """One run from the best plan: take its plan if it fits and is faster; its bound if it bounds the real budget.

        The conservative model is stricter than the budget, so its bound bounds nothing real;
        the optimistic and the exact ones are relaxations of (or equal to) the real problem.
        """
        outcome = self._try(rounding=rounding, start=self.best)
        self.stopped |= outcome.stopped
        if outcome.plan is not None and outcome.fits and (
                self.weights.evaluate(outcome.plan) < self.weights.evaluate(self.best)):
            self.best = outcome.plan
        relaxation = rounding.exact or not rounding.up
        if relaxation and outcome.bound is not None:
            self._raise_bound(outcome.bound)
        if relaxation and outcome.certified and outcome.fits:
            self._raise_bound(self.weights.evaluate(outcome.plan))  # its optimum, found and checked
        if outcome.status == "infeasible" and rounding.well_scaled and relaxation:
            logger.warning("ilp: the %s backend calls budget %d infeasible although %s keeps %d bytes within it; "
                           "numerical trouble, nothing proven", self.context.backend, self.context.budget_bytes,
                           self.best.solver, self.best.kept_bytes)
        logger.debug("ilp: %d-byte units rounded %s: %s, bound %s, certified %s", rounding.quantum,
                     "exactly" if rounding.exact else ("up" if rounding.up else "down"), outcome.status,
                     outcome.bound, outcome.certified)

    def lp_bound(self, rounding: Rounding) -> None:
        """The LP relaxation's optimum: a weak but honest bound when no run gave one."""
        outcome = self._try(rounding=rounding, mip=False)
        if outcome.bound is not None:
            self._raise_bound(outcome.bound)

    def verdict(self) -> tuple[Status, float | None]:
        if self.closed:
            return Status.OPTIMAL, 0.0
        # With no bound believed, recompute time is still at least 0: a gap of 100%, said as such.
        gap = relative_gap(self.weights.evaluate(self.best), 0.0 if self.bound is None else self.bound)
        stopped = self.stopped or clock.now() >= self.context.deadline
        return (Status.TIME_LIMIT if stopped else Status.FEASIBLE), gap

    def _raise_bound(self, bound: float) -> None:
        self.bound = bound if self.bound is None else max(self.bound, bound)

    def _try(self, **options: object) -> Outcome:
        if clock.now() >= self.context.deadline:  # the limit holds: no run starts after it
            self.stopped = True
            return Outcome(MipResult(status="no_solution", backend=self.context.backend, stopped=True))
        return _try_run(self.context, self.weights, **options)


def _fewest_bytes(context: _Context, plan: Plan, weights: Weights) -> Plan:
    """Among plans no slower than ``plan``, one keeping the fewest bytes, then the fewest recomputes.

    A well-scaled run with a time row at ``plan``'s time (``solve_once``'s ``time_cap``); its
    answer is taken only if it is really no slower and keeps fewer bytes (or as many, with fewer
    recomputes). Needs no budget row: fewer bytes than ``plan`` fit whatever ``plan`` fits.
    """
    if clock.now() >= context.deadline:
        return plan
    cap = weights.evaluate(plan) * (1 + 1e-9) + 1e-9
    outcome = _try_run(context, weights, rounding=rounding_for(context.problem), start=plan, time_cap=cap)
    found = outcome.plan
    if found is None or found.kept_bytes > context.budget_bytes:
        return plan
    slower = found.recompute_seconds > plan.recompute_seconds * (1 + 1e-12) + 1e-15
    smaller = (found.kept_bytes, len(found.recomputed)) < (plan.kept_bytes, len(plan.recomputed))
    return found if smaller and not slower else plan


def _try_run(context: _Context, weights: Weights, *, rounding: Rounding, **options: object) -> Outcome:
    """A run that only sharpens the answer: a crash costs the bound, not the plan already found."""
    try:
        return solve_once(context.problem, context.budget_bytes, rounding=rounding, weights=weights,
                          time_limit=_remaining(context.deadline), backend=context.backend, threads=context.threads,
                          **options)
    except SolverError as error:
        logger.warning("ilp: a run failed, the gap may be unknown: %s", error)
        return Outcome(MipResult(status="no_solution", backend=context.backend))
