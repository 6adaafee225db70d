"""Peak-aware planning: the least recompute time whose simulated step peak fits the budget.

A bound on saved bytes does not bound the peak: recomputed chains are held until their last
use, so a plan that keeps less can peak higher (``solvers.memory``). Modelling the memory of
every step exactly (Checkmate) makes the ILP grow with the square of the graph. Here the ILP
gets rows the simulator justifies, and every plan is checked on the simulator:

1. ``peak_rows``: one *valid* row per backward interval (what any plan that keeps or
   recomputes a value must have alive there) and one at the forward's end. With storages
   rounded down this is a relaxation: its bound is a proven lower bound on the recompute time
   of every plan whose simulated peak fits. The same rows rounded up (plus the transient inputs
   of recomputed values) give plans; where one overshoots, valid cuts explain the storages the
   rows missed (a chain recomputed early and held, a kept value a later recompute reads), else
   the rows ask for the overshoot as margin, and the ILP runs again.
2. The older search over saved-bytes caps (secant, then a few rounds of rows at the offending
   step on the best cap that still overshoots) adds its plans.
3. The checkpointing baselines (``per_block``: torch.utils.checkpoint per block) are
   candidates too, so the answer is never worse than them under this peak model.

The answer is the cheapest candidate whose simulated peak fits: "optimal" only when its cost
meets the proven bound, else "feasible" with the gap to it (None when no bound was proven).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pulp

from . import baselines
from ._mip import fraction, resolve_backend, run_mip
from ._model import Model, build, plan_from, rounding_for, time_weights, weights_for
from ._run import solve_once
from .errors import BudgetInfeasibleError
from .memory import PlanMemory, backward_lifetimes, backward_steps_of, read_spans, simulate_plan
from .peak_rows import PeakRows, cuts_at
from .refresh import refresh_to_fit
from .problem import Plan, Problem
from .registry import Decision, planner
from .status import DEFAULT_TIME_LIMIT, BudgetKind, Status, relative_gap

logger = logging.getLogger(__name__)

DEFAULT_ROUNDS = 4
# Rounds of valid cuts (each one ILP solve) before the peak-row search gives up.
CUT_ROUNDS = 12
# Saved-bytes caps (fractions of keep-all) probed when a search finds nothing that fits.
PROBE_FRACTIONS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7)
PROBE_TIME_LIMIT = 30.0
# Multiple recomputation of overshooting plans may run this share of the time limit past it.
REFRESH_SHARE = 0.2
# A plan this close (relative) to the proven lower bound is called optimal.
PROVEN_GAP = 1e-6


@dataclass(frozen=True)
class _Candidate:
    plan: Plan
    memory: PlanMemory


class _PeakModel:
    """The saved-bytes model plus the peak rows added so far."""

    def __init__(self, problem: Problem, peak_budget: int, pinned_bytes: int, saved_cap: int) -> None:
        self.problem = problem
        self.rounding = rounding_for(problem)
        cap = saved_cap if saved_cap < problem.keep_all_bytes() else None
        self.model: Model = build(problem, self.rounding, cap, weights_for(problem))
        self.peak_budget = peak_budget
        self.pinned_bytes = pinned_bytes
        self.first_read, self.last_read = read_spans(problem)
        self.rows = 0
        self.heuristic_rows = 0  # rows that may cut off a fitting plan: no optimality claim then

    def _alive_row(self, keep_terms: dict[int, list[int]], recompute_terms: dict[int, list[int]], room: int) -> None:
        """sum over storages of bytes * alive_s <= room, alive_s >= each listed k_v / r_v."""
        lp, model, q = self.model.lp, self.model, self.rounding.quantum
        storages = sorted(set(keep_terms) | set(recompute_terms))
        if not storages:
            return
        self.rows += 1
        alive = {s: fraction(lp, f"alive{self.rows}_{s}") for s in storages}
        for s in storages:
            for v in keep_terms.get(s, ()):
                if v in model.keep:
                    lp += alive[s] >= model.keep[v], f"alive{self.rows}_k{v}"
            for v in recompute_terms.get(s, ()):
                if v in model.recompute:
                    lp += alive[s] >= model.recompute[v], f"alive{self.rows}_r{v}"
        sizes = self.problem.storage_bytes
        lp += pulp.lpSum(-(-sizes[s] // q) * alive[s] for s in storages) <= max(room, 0) // q, f"peak{self.rows}"

    def add_valid_row(self, step: int) -> bool:
        """Storages that any plan keeping/recomputing them has alive at backward ``step``."""
        problem, values = self.problem, self.problem.values
        keep_terms: dict[int, list[int]] = {}
        recompute_terms: dict[int, list[int]] = {}
        for v, last in self.last_read.items():
            storage = values[v].storage
            if problem.storage_bytes[storage] == 0 or last < step:
                continue
            keep_terms.setdefault(storage, []).append(v)
            if self.first_read[v] <= step:
                recompute_terms.setdefault(storage, []).append(v)
        room = self.peak_budget - self.pinned_bytes - backward_steps_of(problem)[step].working_bytes
        self._alive_row(keep_terms, recompute_terms, room)
        return True

    def add_no_good_row(self, plan: Plan, alive_storages: set[int], working: int) -> None:
        """Forbid this plan's set of storages alive together at its peak."""
        self.heuristic_rows += 1
        values = self.problem.values
        keep_terms: dict[int, list[int]] = {}
        recompute_terms: dict[int, list[int]] = {}
        for v in plan.kept | plan.recomputed:
            storage = values[v].storage
            if storage in alive_storages:
                (keep_terms if v in plan.kept else recompute_terms).setdefault(storage, []).append(v)
        self._alive_row(keep_terms, recompute_terms, self.peak_budget - self.pinned_bytes - working)


def _alive_at_peak(problem: Problem, plan: Plan, memory: PlanMemory) -> tuple[int | None, set[int], int]:
    """The backward step of the peak, the plan's storages alive then, and the working bytes."""
    if memory.peak_phase != "backward":
        return None, set(), 0
    events, lifetimes = backward_lifetimes(problem, plan)
    at = memory.peak_index
    values = problem.values
    alive = set()
    for lifetime in lifetimes:
        if lifetime.begin <= at <= lifetime.end and problem.storage_bytes[values[lifetime.value].storage] > 0:
            alive.add(values[lifetime.value].storage)
    step = events[at].step
    working = backward_steps_of(problem)[step].working_bytes
    return step, alive, working


def _pinned_bytes(problem: Problem) -> int:
    return problem.bytes_of(problem.forward_outputs)


@planner("ilp_peak", description="the ILP with simulated peak rows: the budget bounds the step's activation peak",
         exact=False, bounds=BudgetKind.PEAK)
def solve_peak(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    backend: str = "auto",
    rounds: int = DEFAULT_ROUNDS,
    threads: int | None = None,
    cap_solver: str = "ilp",
    host_budget_bytes: int | None = None,
) -> Decision:
    """The least recompute time whose simulated activation peak is at most ``budget_bytes``.

    ``cap_solver`` solves each saved-bytes cap: "ilp" (exact), or "fast" for deep models (the
    Lagrangian min-cut solver of ``solvers.mincut``; the peak-row rounds are then skipped,
    since they extend the ILP's model), or "ilp_offload" (keep, recompute or offload; caps
    bound device bytes, ``host_budget_bytes`` the host's; no peak rows either). Plans are
    ranked by predicted extra time: recompute plus exposed transfer time.

    With ``cap_solver="ilp"``: the valid peak rows first (a proven lower bound, then plans and
    cuts), then the saved-bytes-cap search; the other cap solvers only run that search. The
    baselines are candidates throughout. Raises BudgetInfeasibleError (kind "peak") with the
    lowest peak found when nothing fits.
    """
    began = time.perf_counter()
    keep_all = baselines.keep_all(problem)
    keep_all_memory = simulate_plan(problem, keep_all)
    if budget_bytes is None or keep_all_memory.peak_bytes <= budget_bytes:
        return _finish(keep_all, keep_all_memory, Status.OPTIMAL, 0.0)
    if cap_solver not in ("ilp", "fast", "ilp_offload"):
        raise ValueError(f"cap_solver must be 'ilp', 'fast' or 'ilp_offload', got {cap_solver!r}")
    search = _Search(problem, budget_bytes, resolve_backend(backend), began + time_limit, threads, cap_solver)
    search.host_budget_bytes = host_budget_bytes
    if cap_solver == "ilp_offload":  # its MIP rarely closes its gap: give each cap a share, not all
        search.cap_seconds = time_limit / 8
    search.candidates += [_Candidate(p, simulate_plan(problem, p)) for p in baselines.heuristic_plans(problem)]
    bound: float | None = None
    if cap_solver == "ilp":
        bound = search.with_step_rows(CUT_ROUNDS)

    if search._left() > 0.1:  # the saved-bytes-cap search finds other plans: keep the best of both
        search.over_saved_cap(keep_all_memory)
        if search.overshooting_cap is not None and cap_solver == "ilp":
            search.with_peak_rows(search.overshooting_cap, rounds)
    search.refresh_cheaper(budget_bytes, began + time_limit * (1 + REFRESH_SHARE))
    fitting = [c for c in search.candidates if c.memory.peak_bytes <= budget_bytes]
    if not fitting:
        # The stated minimum must itself work when tried, so it comes from a fixed probe of
        # the trade-off curve that every failing search repeats, not from this budget's search.
        probes = search.probe()
        fitting = [c for c in probes if c.memory.peak_bytes <= budget_bytes]
        if not fitting:
            lowest = min(c.memory.peak_bytes for c in probes)
            raise BudgetInfeasibleError(budget_bytes, lowest, keep_all_memory.peak_bytes, kind="peak")
    best = min(fitting, key=lambda c: (c.plan.predicted_extra_seconds, c.memory.peak_bytes, c.plan.kept_bytes))
    if best.plan.refreshed:  # the rows' bound holds each recomputed value across its reads: not for this plan
        bound = None
    gap = relative_gap(best.plan.predicted_extra_seconds, bound)
    if gap is not None and gap <= PROVEN_GAP:
        return _finish(best.plan, best.memory, Status.OPTIMAL, 0.0)
    return _finish(best.plan, best.memory, Status.FEASIBLE, gap)


class _Search:
    """Plans tried so far, and the two ways of finding more."""

    def __init__(self, problem: Problem, budget: int, backend: str, deadline: float, threads: int | None,
                 cap_solver: str = "ilp") -> None:
        self.problem, self.budget, self.backend, self.deadline, self.threads = problem, budget, backend, deadline, threads
        self.cap_solver = cap_solver
        self.candidates: list[_Candidate] = []
        self.overshooting_cap: int | None = None
        self.proven: _Candidate | None = None
        self.floor = 0  # no cap below the smallest feasible saved bytes makes sense
        self.proven_infeasible = False  # the relaxation of the peak rows has no solution
        self.host_budget_bytes: int | None = None  # for cap_solver "ilp_offload"
        self.cap_seconds: float | None = None  # at most this long per cap solve (None: all that is left)

    def _left(self) -> float:
        return self.deadline - time.perf_counter()

    def _try_cap(self, cap: int, time_limit: float | None = None) -> _Candidate | None:
        from .fast import solve_fast
        from .ilp import solve_ilp

        seconds = max(self._left(), 0.1) if time_limit is None else time_limit
        if self.cap_seconds is not None:
            seconds = min(seconds, self.cap_seconds)
        try:
            if self.cap_solver == "fast":
                plan = solve_fast(self.problem, cap, time_limit=seconds, backend=self.backend)
            elif self.cap_solver == "ilp_offload":
                from .offload_planner import solve_offload

                plan = solve_offload(self.problem, cap, time_limit=seconds, backend=self.backend, threads=self.threads,
                                     host_budget_bytes=self.host_budget_bytes)
            else:
                plan = solve_ilp(self.problem, cap, time_limit=seconds, backend=self.backend, threads=self.threads)
        except BudgetInfeasibleError as error:
            self.floor = max(self.floor, error.min_bytes)
            return None
        candidate = _Candidate(plan, simulate_plan(self.problem, plan))
        self.candidates.append(candidate)
        logger.debug("ilp_peak: saved cap %d -> kept %d, peak %d (budget %d)", cap, plan.kept_bytes,
                     candidate.memory.peak_bytes, self.budget)
        return candidate

    def probe(self, fractions: tuple[float, ...] = PROBE_FRACTIONS) -> list[_Candidate]:
        """Plans at fixed saved-bytes caps (and the baselines): the same for every budget."""
        keep_all_bytes = self.problem.keep_all_bytes()
        found = [_Candidate(p, simulate_plan(self.problem, p)) for p in baselines.heuristic_plans(self.problem)]
        for share in fractions:
            candidate = self._try_cap(max(int(share * keep_all_bytes), 1), time_limit=PROBE_TIME_LIMIT)
            if candidate is not None:
                found.append(candidate)
        if self.floor > 0:  # the least-bytes plan itself
            candidate = self._try_cap(self.floor, time_limit=PROBE_TIME_LIMIT)
            if candidate is not None:
                found.append(candidate)
        self.candidates += found
        return found

    def over_saved_cap(self, keep_all_memory: PlanMemory, iterations: int = 10) -> None:
        """Largest saved-bytes cap whose plan's simulated peak fits (secant, then bisection)."""
        keep_all_bytes = self.problem.keep_all_bytes()
        overhead = keep_all_memory.peak_bytes - keep_all_bytes
        fits_at: int | None = None
        over_at: int | None = keep_all_bytes
        cap = max(self.budget - overhead, 1)
        tolerance = max(keep_all_bytes // 200, 1)
        for _ in range(iterations):
            if self._left() <= 0.1:
                break
            cap = max(cap, self.floor, 1)
            candidate = self._try_cap(cap)
            if candidate is None:  # below the smallest feasible cap
                cap = self.floor
                continue
            peak = candidate.memory.peak_bytes
            if peak <= self.budget:
                fits_at = max(fits_at or 0, cap)
            else:
                over_at = cap if over_at is None else min(over_at, cap)
            if fits_at is not None and over_at is not None and over_at - fits_at <= tolerance:
                break
            if fits_at is None:
                cap = cap - (peak - self.budget) - tolerance  # step down by the excess
                if cap < self.floor:
                    if self.floor in (0, cap):
                        break
                    cap = self.floor
            elif over_at is None:
                cap = cap + (self.budget - peak)
            else:
                cap = (fits_at + over_at) // 2
        self.overshooting_cap = over_at if fits_at is not None and over_at is not None else None

    def with_step_rows(self, rounds: int) -> float | None:
        """Plans from the ILP with a valid peak row per backward interval (``peak_rows``).

        First the relaxation (storages rounded down, exact seconds as the objective): its bound
        is a proven lower bound on the recompute seconds of any plan that fits, returned. Then
        the same rows rounded up, tightened after each round by what the simulated plan still
        overshoots. Every plan becomes a candidate. None when no bound was proven.
        """
        problem, rounding = self.problem, rounding_for(self.problem)
        seconds, unit = time_weights(problem)
        relaxed = rounding.optimistic()
        outcome = solve_once(problem, None, rounding=relaxed, weights=seconds, time_limit=max(self._left() / 3, 0.1),
                             backend=self.backend, threads=self.threads,
                             extension=PeakRows(problem, self.budget, relaxed))
        if outcome.status == "infeasible":
            self.proven_infeasible = True
            return None
        bound = outcome.bound * unit if outcome.bound is not None else None
        if outcome.plan is not None:
            self._add(outcome.plan)
        self._rounds(rounds, self._left() / 2)  # the cap search and its rounds get the rest
        return bound

    def _rounds(self, rounds: int, reserve: float) -> None:
        """ILP plans under the conservative peak rows, tightened by cuts or a margin while they
        overshoot."""
        problem, rounding = self.problem, rounding_for(self.problem)
        margin, cuts = 0, set()
        weights = weights_for(problem)
        for round_index in range(rounds):
            if self._left() <= max(reserve, 0.1):
                break
            outcome = solve_once(problem, None, rounding=rounding, weights=weights,
                                 time_limit=max(self._left() - reserve, 0.1), backend=self.backend, threads=self.threads,
                                 extension=PeakRows(problem, self.budget, rounding, margin, tuple(sorted(
                                     cuts, key=lambda c: (c.step, c.storage, c.literals))), transients=True,
                                     kept_readers=True))
            if outcome.plan is None:
                break
            candidate = self._add(outcome.plan)
            logger.debug("ilp_peak: step rows, margin %d, %d cuts: kept %d, peak %d (budget %d)", margin, len(cuts),
                         outcome.plan.kept_bytes, candidate.memory.peak_bytes, self.budget)
            if candidate.memory.peak_bytes <= self.budget:
                break
            step, alive, _ = _alive_at_peak(problem, outcome.plan, candidate.memory)
            new = set(cuts_at(problem, outcome.plan, step, alive)) - cuts if step is not None else set()
            if new:
                cuts |= new
            else:  # nothing valid explains the excess: ask the rows for that much more room
                margin += candidate.memory.peak_bytes - self.budget

    def refresh_cheaper(self, budget: int, deadline: float) -> None:
        """Multiple recomputation (``solvers.refresh``) on the plans that overshoot, cheapest
        first, while they are cheaper than the best plan that fits."""
        fitting = [c.plan.predicted_extra_seconds for c in self.candidates if c.memory.peak_bytes <= budget]
        best = min(fitting, default=float("inf"))
        over = sorted((c for c in self.candidates if c.memory.peak_bytes > budget),
                      key=lambda c: c.plan.predicted_extra_seconds)
        tried: set[tuple[frozenset[int], frozenset[int]]] = set()
        for candidate in over:
            plan = candidate.plan
            if plan.predicted_extra_seconds >= best or time.perf_counter() > deadline:
                break
            if (plan.kept, plan.recomputed) in tried or plan.offloaded:
                continue
            tried.add((plan.kept, plan.recomputed))
            found = refresh_to_fit(self.problem, plan, budget, deadline, candidate.memory)
            if found is not None:
                refreshed = _Candidate(*found)
                self.candidates.append(refreshed)
                best = min(best, refreshed.plan.predicted_extra_seconds)
                logger.debug("ilp_peak: refreshing %d values fits a plan of %.3g s", len(refreshed.plan.refreshed),
                             refreshed.plan.predicted_extra_seconds)

    def _add(self, plan: Plan) -> _Candidate:
        candidate = _Candidate(plan, simulate_plan(self.problem, plan))
        self.candidates.append(candidate)
        return candidate

    def with_peak_rows(self, cap: int, rounds: int) -> None:
        """From a cap whose plan overshoots, add peak rows until a plan fits (or rounds run out)."""
        peak_model = _PeakModel(self.problem, self.budget, _pinned_bytes(self.problem), saved_cap=cap)
        for round_index in range(rounds):
            if self._left() <= 0.1:
                break
            result = run_mip(peak_model.model.lp, backend=self.backend, time_limit=self._left(), threads=self.threads)
            if result.status not in ("optimal", "feasible"):
                break
            plan = plan_from(self.problem, peak_model.model, result, solver="ilp_peak")
            candidate = _Candidate(plan, simulate_plan(self.problem, plan))
            self.candidates.append(candidate)
            memory = candidate.memory
            logger.debug("ilp_peak: row round %d: kept %d, peak %d", round_index, plan.kept_bytes, memory.peak_bytes)
            if memory.peak_bytes <= self.budget:
                if result.status == "optimal" and peak_model.heuristic_rows == 0:
                    self.proven = candidate
                return
            step, alive, working = _alive_at_peak(self.problem, plan, memory)
            if step is None:
                _tighten_saved(peak_model, plan)
                continue
            peak_model.add_valid_row(step)
            if _row_holds(self.problem, plan, step, self.budget, peak_model.pinned_bytes):
                peak_model.add_no_good_row(plan, alive, working)


def _row_holds(problem: Problem, plan: Plan, step: int, budget_bytes: int, pinned: int) -> bool:
    """Whether the valid row at ``step`` is already satisfied by ``plan`` (so it cannot help)."""
    first, last = read_spans(problem)
    values = problem.values
    storages = set()
    for v in plan.kept:
        if last.get(v, -1) >= step:
            storages.add(values[v].storage)
    for v in plan.recomputed:
        if first.get(v, step + 1) <= step <= last.get(v, -1):
            storages.add(values[v].storage)
    used = sum(problem.storage_bytes[s] for s in storages)
    return used + pinned + backward_steps_of(problem)[step].working_bytes <= budget_bytes


def _tighten_saved(peak_model: _PeakModel, plan: Plan) -> None:
    """The forward peak is over: ask for fewer kept bytes than this plan keeps."""
    lp, model, q = peak_model.model.lp, peak_model.model, peak_model.rounding.quantum
    peak_model.rows += 1
    peak_model.heuristic_rows += 1
    lp += pulp.lpSum(peak_model.rounding.units(s) * g for s, g in model.paid.items()) <= max(
        plan.kept_bytes - q, 0) // q, f"saved{peak_model.rows}"


def _finish(plan: Plan, memory: PlanMemory, status: Status, gap: float | None) -> Decision:
    return Decision.of(plan, status, gap, source=plan.solver, predicted_peak_bytes=memory.peak_bytes)
