"""Rows added to a saved-bytes cap's ILP where its plan overshoots the peak budget.

The older of ``ilp_peak``'s two row searches (``solvers.peak.planner``): start from the ILP of a
saved-bytes cap whose plan peaks over the budget, and add, where the simulated plan peaks, the
valid row of that backward step (``add_valid_row``) or, when that row already holds, a no-good
row against the set of storages alive together there. Rows of the second kind may cut off a
plan that fits, so a plan from this model is never called optimal once one was added.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pulp

from .. import clock
from ..mip.solve import fraction, run_mip
from ..mip.keep_model import Model, build, plan_from, rounding_for, weights_for
from ..analysis.memory import PlanMemory, peak_step_alive, simulate_plan
from ..analysis.lifetimes import backward_steps_of, read_spans
from ..problem import Plan, Problem

logger = logging.getLogger(__name__)


class CapPeakModel:
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


def pinned_bytes(problem: Problem) -> int:
    return problem.bytes_of(problem.forward_outputs)


def row_holds(problem: Problem, plan: Plan, step: int, budget_bytes: int, pinned: int) -> bool:
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


def tighten_saved(peak_model: CapPeakModel, plan: Plan) -> None:
    """The forward peak is over: ask for fewer kept bytes than this plan keeps."""
    lp, model, q = peak_model.model.lp, peak_model.model, peak_model.rounding.quantum
    peak_model.rows += 1
    peak_model.heuristic_rows += 1
    lp += pulp.lpSum(peak_model.rounding.units(s) * g for s, g in model.paid.items()) <= max(
        plan.kept_bytes - q, 0) // q, f"saved{peak_model.rows}"


def plans_from_cap(problem: Problem, budget_bytes: int, cap: int, rounds: int, deadline: float, *, backend: str,
                   threads: int | None) -> Iterator[tuple[Plan, PlanMemory]]:
    """From a saved-bytes cap whose plan overshoots, each round's plan (and its simulated memory)
    as peak rows are added where the last one peaked, until one fits, or rounds or time run out."""
    peak_model = CapPeakModel(problem, budget_bytes, pinned_bytes(problem), saved_cap=cap)
    for round_index in range(rounds):
        if deadline - clock.now() <= 0.1:
            return
        result = run_mip(peak_model.model.lp, backend=backend, time_limit=deadline - clock.now(),
                         threads=threads)
        if result.status not in ("optimal", "feasible"):
            return
        plan = plan_from(problem, peak_model.model, result, solver="ilp_peak")
        memory = simulate_plan(problem, plan)
        logger.debug("ilp_peak: row round %d: kept %d, peak %d", round_index, plan.kept_bytes, memory.peak_bytes)
        yield plan, memory
        if memory.peak_bytes <= budget_bytes:
            return
        step, alive, working = peak_step_alive(problem, plan, memory)
        if step is None:
            tighten_saved(peak_model, plan)
            continue
        peak_model.add_valid_row(step)
        if row_holds(problem, plan, step, budget_bytes, peak_model.pinned_bytes):
            peak_model.add_no_good_row(plan, alive, working)
