"""The search over saved-bytes caps: the older half of the peak planner (``planner``), and its probe.

A saved-bytes cap is a quick ILP (``solvers.ilp``, or "fast", or "ilp_offload"): the least
recompute that keeps at most the cap. Its plan's simulated peak is what the budget bounds, so the
search looks for the largest cap whose plan fits (secant, then bisection). Each cap is solved once
per call (a cap asked again, when the search resumes after the peak rows or runs on before a
refusal, is answered from memory), and every plan becomes a candidate. When nothing fits, a fixed
probe of caps (the same for every budget) gives the smallest budget an error can state honestly; the
peak planner adds plans that peak lower to it (``planner._Search._probed``).
The probe is remembered per problem in this process (``_PROBED``): the Inductor fit refuses several
budgets of one graph, and each probe solves up to ten caps (27 s on a 12-layer GPT-2).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Hashable

from .. import baselines, clock
from ..analysis.memory import PlanMemory, simulate_plan
from ..errors import BudgetInfeasibleError, SolverError
from ..problem import Plan, Problem

logger = logging.getLogger(__name__)

# Saved-bytes caps (fractions of keep-all) probed when a search finds nothing that fits.
PROBE_FRACTIONS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7)
PROBE_TIME_LIMIT = 30.0
PROBES_REMEMBERED = 4


_PROBED: "OrderedDict[Hashable, list[Candidate]]" = OrderedDict()
"""``CapSearch.probe``'s answers, most recent last, by problem and settings."""


@dataclass(frozen=True)
class Candidate:
    """A plan and its simulated memory."""

    plan: Plan
    memory: PlanMemory


class CapSearch:
    """Plans tried so far (``candidates``) and the cap search that adds to them, until ``deadline``."""

    def __init__(self, problem: Problem, budget: int, backend: str, deadline: float, threads: int | None,
                 cap_solver: str = "ilp") -> None:
        self.problem, self.budget, self.backend, self.deadline, self.threads = problem, budget, backend, deadline, threads
        self.cap_solver = cap_solver
        self.candidates: list[Candidate] = []
        self.overshooting_cap: int | None = None
        self.floor = 0  # no cap below the smallest feasible saved bytes makes sense
        self.host_budget_bytes: int | None = None  # for cap_solver "ilp_offload"
        self.cap_seconds: float | None = None  # at most this long per cap solve (None: all that is left)
        self.tried_caps: dict[int, Candidate | None] = {}  # saved-bytes cap -> its plan (None: infeasible)

    def _left(self) -> float:
        return self.deadline - clock.now()

    def _try_cap(self, cap: int, time_limit: float | None = None) -> Candidate | None:
        """The plan of saved-bytes cap ``cap`` (None below the smallest feasible one, or out of time), solved once:
        a cap asked again (the cap search resumed after the peak rows) is answered from memory."""
        if cap in self.tried_caps:
            return self.tried_caps[cap]
        try:
            found = self._solve_cap(cap, time_limit)
        except SolverError as error:  # out of time on this cap (not remembered: with more it may solve)
            logger.debug("ilp_peak: saved cap %d: %s", cap, error)
            return None
        self.tried_caps[cap] = found
        return found

    def _solve_cap(self, cap: int, time_limit: float | None) -> Candidate | None:
        from ..fast import solve_fast
        from ..ilp import solve_ilp

        seconds = max(self._left(), 0.1) if time_limit is None else time_limit
        if self.cap_seconds is not None:
            seconds = min(seconds, self.cap_seconds)
        try:
            if self.cap_solver == "fast":
                plan = solve_fast(self.problem, cap, time_limit=seconds, backend=self.backend)
            elif self.cap_solver == "ilp_offload":
                from ..offload_planner import solve_offload

                plan = solve_offload(self.problem, cap, time_limit=seconds, backend=self.backend, threads=self.threads,
                                     host_budget_bytes=self.host_budget_bytes)
            else:
                plan = solve_ilp(self.problem, cap, time_limit=seconds, backend=self.backend, threads=self.threads)
        except BudgetInfeasibleError as error:
            self.floor = max(self.floor, error.min_bytes)
            return None
        candidate = Candidate(plan, simulate_plan(self.problem, plan))
        self.candidates.append(candidate)
        logger.debug("ilp_peak: saved cap %d -> kept %d, peak %d (budget %d)", cap, plan.kept_bytes,
                     candidate.memory.peak_bytes, self.budget)
        return candidate

    def probe(self, fractions: tuple[float, ...] = PROBE_FRACTIONS) -> list[Candidate]:
        """Plans at fixed saved-bytes caps (and the baselines): the same for every budget, so
        solved once per problem and settings in this process."""
        key = (self.problem, fractions, self.floor, self.backend, self.threads, self.cap_solver, self.host_budget_bytes)
        remembered = _PROBED.get(key)
        if remembered is None:
            remembered = self._probed(fractions)
            _PROBED[key] = remembered
            while len(_PROBED) > PROBES_REMEMBERED:
                _PROBED.popitem(last=False)
        else:
            logger.info("ilp_peak: the probe of this problem's trade-off curve was solved before; reusing it")
        # An equal problem may be another object: the plans are rebuilt on this one.
        found = [Candidate(replace(c.plan, problem=self.problem), c.memory) for c in remembered]
        self.candidates += found
        return found

    def _probed(self, fractions: tuple[float, ...]) -> list[Candidate]:
        keep_all_bytes = self.problem.keep_all_bytes()
        found = [Candidate(p, simulate_plan(self.problem, p)) for p in baselines.heuristic_plans(self.problem)]
        for share in fractions:
            candidate = self._try_cap(max(int(share * keep_all_bytes), 1), time_limit=PROBE_TIME_LIMIT)
            if candidate is not None:
                found.append(candidate)
        if self.floor > 0:  # the least-bytes plan itself
            candidate = self._try_cap(self.floor, time_limit=PROBE_TIME_LIMIT)
            if candidate is not None:
                found.append(candidate)
        return found

    def over_saved_cap(self, keep_all_memory: PlanMemory, iterations: int = 10, until: float | None = None) -> None:
        """Largest saved-bytes cap whose plan's simulated peak fits (secant, then bisection),
        searched until ``until`` (the search's deadline by default)."""
        keep_all_bytes = self.problem.keep_all_bytes()
        overhead = keep_all_memory.peak_bytes - keep_all_bytes
        fits_at: int | None = None
        over_at: int | None = keep_all_bytes
        cap = max(self.budget - overhead, 1)
        tolerance = max(keep_all_bytes // 200, 1)
        until = self.deadline if until is None else min(until, self.deadline)
        for _ in range(iterations):
            if until - clock.now() <= 0.1:
                break
            cap = max(cap, self.floor, 1)
            candidate = self._try_cap(cap, time_limit=until - clock.now())
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


def refusal(budget_bytes: int, candidates: list[Candidate], keep_all_peak_bytes: int) -> BudgetInfeasibleError:
    """The refusal of a peak budget: the lowest peak among ``candidates``, and what that plan keeps."""
    lowest = min(candidates, key=lambda c: c.memory.peak_bytes)
    return BudgetInfeasibleError(budget_bytes, lowest.memory.peak_bytes, keep_all_peak_bytes, kind="peak",
                                 lowest_kept_bytes=lowest.plan.kept_bytes)
