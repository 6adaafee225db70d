"""Local search over keep sets, judged by the simulator: cheaper plans that still fit the peak.

The peak planner's MIPs (``solvers.peak``) see the peak through rows that are either relaxed
(valid, so their plans may not fit) or conservative (so they miss plans that do), and with the
exact rows (``solvers.exact_rows``) they close their gap slowly. The simulator itself is cheap
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
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ._graph import relevant_values
from .memory import simulate_plan
from .problem import Plan, Problem, closure_from_keep_set

# Graph distance (either direction) within which a kept value is tried as the one to give up.
NEAR_HOPS = 4
SOLVER_NAME = "local_search"  # what a plan it made says made it
# A move must save at least this share of the plan's recompute time (float noise is no saving).
MIN_SAVING = 1e-9


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
        while time.perf_counter() < deadline:
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
        if time.perf_counter() >= deadline:
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
