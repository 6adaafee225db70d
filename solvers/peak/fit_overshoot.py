"""Plans that overshoot a peak budget but are cheaper than the best that fits, made to fit.

The peak planner's MIPs (``solvers.peak.planner``) see the peak through relaxed or conservative rows,
so many of their plans are cheap and a few percent over the budget. Two repairs, both judged
by the simulator: give up kept values alive at the peak (``local_search.repair``), or make held
recomputed values again for each step that reads them (``multiple_recompute.refresh_to_fit``). On deep
models this is where the plans that beat per-block checkpointing come from: there the rounds
of cuts take ~10 s a solve (a 12-layer GPT, 1000 values) and end over the budget.
"""

from __future__ import annotations

import logging

from .. import clock
from .local_search import improve, repair
from ..analysis.memory import PlanMemory, simulate_plan
from ..problem import Plan, Problem
from .multiple_recompute import refresh_to_fit

logger = logging.getLogger(__name__)

# Share of what is left of the window that one plan's repair may use: a repair that fails can
# take long on deep models (each try of a step is simulated), and the other plans get theirs.
REPAIR_SHARE = 0.5


def fit_cheaper(problem: Problem, plans: list[tuple[Plan, PlanMemory]], budget: int, deadline: float,
                repair_kept: bool = True) -> list[tuple[Plan, PlanMemory]]:
    """Plans that fit, each cheaper than the best of ``plans`` that fits when it was found.

    Overshooting plans are tried closest to the budget first, each refreshed and repaired; a
    repaired plan that becomes the best is improved by the local search. Without
    ``repair_kept`` only refreshing is tried (a repaired plan stays inside the peak model, so
    none beats a proven optimum of it).
    """
    best = min((plan.predicted_extra_seconds for plan, memory in plans if memory.peak_bytes <= budget),
               default=float("inf"))
    over = sorted(((plan, memory) for plan, memory in plans if memory.peak_bytes > budget and not plan.offloaded),
                  key=lambda item: (item[1].peak_bytes, item[0].predicted_extra_seconds))
    found: list[tuple[Plan, PlanMemory]] = []
    tried: set[tuple[frozenset[int], frozenset[int]]] = set()
    repaired: Plan | None = None
    for plan, memory in over:
        if clock.now() > deadline:
            break
        if plan.predicted_extra_seconds >= best or (plan.kept, plan.recomputed) in tried:
            continue
        tried.add((plan.kept, plan.recomputed))
        refreshed = refresh_to_fit(problem, plan, budget, deadline, memory)
        slice_end = min(deadline, clock.now() + REPAIR_SHARE * (deadline - clock.now()))
        given_up = repair(problem, plan, budget, slice_end, memory) if repair_kept else None
        for how, fitting in (("refreshing", refreshed), ("giving up kept values", given_up)):
            if fitting is None or fitting[0].predicted_extra_seconds >= best:
                continue
            found.append(fitting)
            best = fitting[0].predicted_extra_seconds
            repaired = fitting[0] if not fitting[0].refreshed else None
            logger.debug("ilp_peak: %s fits a plan of %.4g s (it overshot by %d B)", how, best,
                         memory.peak_bytes - budget)
    if repaired is not None and clock.now() < deadline:
        better = improve(problem, repaired, budget, deadline)
        if better is not repaired:
            found.append((better, simulate_plan(problem, better)))
    return found
