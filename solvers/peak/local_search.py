"""Local search over keep sets, judged by the simulator: cheaper plans that still fit the peak.

The peak planner's MIPs (``solvers.peak.planner``) see the peak through rows that are either relaxed
(valid, so their plans may not fit) or conservative (so they miss plans that do), and with the
exact rows (``solvers.peak.exact_rows``) they close their gap slowly. The simulator itself is cheap
(about a millisecond for a four-layer transformer step), so a plan that fits can be improved
directly: keep one more value, or keep one value instead of another, and take the move when the
plan gets cheaper and its simulated peak still fits. On the h64 GPT-style model at per-block
checkpointing's peak this took the plan from per-block's own cost to 0.73x of it in a few
seconds, where the MIPs had not moved in a minute.

Moves are tried first-improvement, in two tiers: keeping ``v`` alone or instead of a kept value
near it in the graph (a few hops: a tensor of the same chain), then instead of any kept value.
The second tier runs only when a whole pass of the first finds nothing. The result is a local
optimum of these moves, or the best plan when the time runs out; every plan is a closure of
its keep set (``closure_from_keep_set``), so it is valid by construction.

``repair`` goes the other way, from a plan that overshoots: it gives up kept values alive at the
peak, the least added recompute time per byte of peak saved first, until the plan fits (the
peak planner runs it on its cheaper plans that overshoot: ``solvers.peak.fit_overshoot``).
"""

from __future__ import annotations

from collections.abc import Iterator

from .. import clock
from ..analysis.graph_facts import relevant_values
from ..analysis.memory import PlanMemory, simulate_plan, storages_alive_at_peak
from ..problem import Plan, Problem, closure_from_keep_set

# Graph distance (either direction) within which a kept value is tried as the one to give up.
NEAR_HOPS = 4
SOLVER_NAME = "local_search"  # what a plan it made says made it
# A move must save at least this share of the plan's recompute time (float noise is no saving).
MIN_SAVING = 1e-9
# Per repair step, the kept values alive at the peak are simulated, the least added recompute time
# per byte of their storage first, until this many lowered the peak (a simulation costs ~17 ms on
# 1000 values); the best price of those is taken.
REPAIR_TRIALS = 12
REPAIR_SOLVER_NAME = "repair"


def improve(problem: Problem, plan: Plan, budget_bytes: int, deadline: float) -> Plan:
    """A plan no costlier than ``plan`` whose simulated peak is at most ``budget_bytes``.

    ``plan`` must fit already; a plan with offloaded or refreshed values is returned as it is
    (the moves only change what is kept).
    """
    if plan.offloaded or plan.refreshed:
        return plan
    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    near = _near(problem, keepable)
    for tier in ("near", "any"):
        while clock.now() < deadline:
            better = _first_improvement(problem, plan, budget_bytes, keepable, near, tier, deadline)
            if better is None:
                break
            plan = better
    return plan


def _first_improvement(problem: Problem, plan: Plan, budget_bytes: int, keepable: list[int],
                       near: dict[int, frozenset[int]], tier: str, deadline: float) -> Plan | None:
    """The first cheaper plan that fits among one pass of moves, None when there is none."""
    target = plan.recompute_seconds * (1 - MIN_SAVING)
    for keep in _moves(plan, keepable, near, tier):
        if clock.now() >= deadline:
            return None
        kept, recomputed = closure_from_keep_set(problem, keep)
        candidate = Plan(problem, kept, recomputed, SOLVER_NAME)
        if candidate.recompute_seconds < target and simulate_plan(problem, candidate).peak_bytes <= budget_bytes:
            return candidate
    return None


def _moves(plan: Plan, keepable: list[int], near: dict[int, frozenset[int]], tier: str) -> Iterator[frozenset[int]]:
    """Keep sets one move away: ``v`` added, or ``v`` instead of a kept value (near ones, or any)."""
    for v in keepable:
        if v in plan.kept:
            continue
        if tier == "near":
            yield plan.kept | {v}
            given_up = sorted(near[v] & plan.kept)
        else:
            given_up = sorted(plan.kept - near[v])
        for u in given_up:
            yield (plan.kept - {u}) | {v}


def _near(problem: Problem, keepable: list[int]) -> dict[int, frozenset[int]]:
    """Per keepable value, the values within ``NEAR_HOPS`` of it, inputs or users."""
    values, users = problem.values, problem.users
    found = {}
    for v in keepable:
        seen, front = {v}, {v}
        for _ in range(NEAR_HOPS):
            front = {w for x in front for w in (*values[x].inputs, *users[x])} - seen
            seen |= front
        found[v] = frozenset(seen - {v})
    return found


def repair(problem: Problem, plan: Plan, budget_bytes: int, deadline: float,
           memory: PlanMemory | None = None) -> tuple[Plan, PlanMemory] | None:
    """``plan`` with kept values given up (recomputed instead) until its simulated peak is at most
    ``budget_bytes``, or None when giving up what is kept at the peak does not get there before
    ``deadline``.

    Each step gives up the kept value alive at the peak whose recomputation adds the least
    recompute time per byte it lowers the peak by (of the first ``REPAIR_TRIALS`` that lower it,
    tried cheapest per byte of storage first). Plans with offloaded or refreshed values are not
    repaired.
    """
    if plan.offloaded or plan.refreshed:
        return None
    memory = memory or simulate_plan(problem, plan)
    while memory.peak_bytes > budget_bytes:
        best: tuple[float, Plan, PlanMemory] | None = None
        lowering = 0
        for trial in _fewer_kept(problem, plan, memory, deadline):
            if lowering >= REPAIR_TRIALS or clock.now() >= deadline:
                break
            trial_memory = simulate_plan(problem, trial)
            saved = memory.peak_bytes - trial_memory.peak_bytes
            if saved > 0:
                lowering += 1
                price = (trial.recompute_seconds - plan.recompute_seconds) / saved
                if best is None or price < best[0]:
                    best = (price, trial, trial_memory)
        if best is None or clock.now() >= deadline:
            return None
        _, plan, memory = best
    return plan, memory


def _fewer_kept(problem: Problem, plan: Plan, memory: PlanMemory, deadline: float) -> list[Plan]:
    """Plans with one kept value alive at the peak given up, the least added recompute time per
    byte of the value's storage first."""
    values, sizes = problem.values, problem.storage_bytes
    # at a forward peak every kept storage may be under it (made before the peak)
    alive = (storages_alive_at_peak(problem, plan, memory) if memory.peak_phase == "backward"
             else {values[v].storage for v in plan.kept})
    priced = []
    for v in sorted(plan.kept):
        if values[v].storage not in alive or not sizes[values[v].storage] or clock.now() >= deadline:
            continue
        kept, recomputed = closure_from_keep_set(problem, plan.kept - {v})
        if kept == plan.kept:
            continue  # v cannot be recomputed
        trial = Plan(problem, kept, recomputed, REPAIR_SOLVER_NAME)
        priced.append(((trial.recompute_seconds - plan.recompute_seconds) / sizes[values[v].storage], v, trial))
    return [trial for _, _, trial in sorted(priced, key=lambda item: item[:2])]
