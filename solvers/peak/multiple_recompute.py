"""Multiple recomputation: refresh recomputed storages that a plan holds across its peak.

A recomputed value is held from its first backward use to its last (``solvers.analysis.memory``). When
those uses are far apart, the value sits in memory across backward steps that never read it:
a block's normalized input, made to rebuild the MLP's input and read again only by the
attention's weight gradients; a copy of the attention output made for the output projection's
input. Refreshing it (``Plan.refreshed``) makes it again in each step that needs it and frees
it after, for its recompute time once per such step. On the FLOP cost profile such values are
usually pointwise ops whose inputs are alive anyway: refreshing them is almost free.

``refresh_to_fit`` is a greedy pass over a finished plan: while the simulated peak is over the
budget, it refreshes the storage whose refreshing lowers the peak step's live bytes at the least
added recompute time per byte, and stops when the plan fits or nothing alive at the peak helps.
The ILP does not choose refreshes itself; ``solvers.peak.planner`` runs this pass on plans that overshoot.
What a refreshed plan must satisfy is checked by the record itself (``Plan.check``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator

from .. import clock
from ..analysis.memory import PlanMemory, simulate_plan
from ..analysis.lifetimes import backward_lifetimes
from ..problem import Plan, Problem

logger = logging.getLogger(__name__)

# At most this many storages are refreshed in one pass (each step simulates every candidate).
MAX_REFRESHES = 64


def refreshable_storages(problem: Problem, plan: Plan) -> dict[int, frozenset[int]]:
    """Storages a refresh may cover, each with its recomputed values: every value of the
    storage that the plan has in backward is recomputed (none kept or offloaded), no forward
    output lives in it, and none of its values is an output of a multi-output op."""
    values = problem.values
    blocked = {values[i].storage for i in plan.kept | plan.offloaded | problem.forward_outputs}
    # An output of a multi-output op (a getitem of its tuple) lives as long as the tuple, which
    # a held recomputation keeps: refreshing it alone would free nothing.
    blocked |= {v.storage for v in values if any(not values[u].keepable and not values[u].available
                                                 for u in v.inputs)}
    found: dict[int, set[int]] = {}
    for i in plan.recomputed:
        storage = values[i].storage
        if storage not in blocked and problem.storage_bytes[storage] > 0:
            found.setdefault(storage, set()).add(i)
    return {s: frozenset(members) for s, members in found.items()}


def refresh_to_fit(problem: Problem, plan: Plan, budget_bytes: int, deadline: float | None = None,
                   memory: PlanMemory | None = None) -> tuple[Plan, PlanMemory] | None:
    """``plan`` with refreshed storages whose simulated peak is at most ``budget_bytes``, or
    None when refreshing what is alive at the peak does not get there (or time runs out)."""
    memory = memory or simulate_plan(problem, plan)
    if memory.peak_bytes <= budget_bytes:
        return plan, memory
    for plan, memory in _refreshing(problem, plan, memory, deadline):
        if memory.peak_bytes <= budget_bytes:
            return plan, memory
    return None


def refresh_lowest(problem: Problem, plan: Plan, deadline: float | None = None,
                   memory: PlanMemory | None = None) -> tuple[Plan, PlanMemory]:
    """The lowest-peak plan of the same greedy pass run without a budget (``plan`` itself where no
    refresh lowers its peak): the smallest budget a refusal can state honestly (``solvers.peak.planner``)."""
    lowest = (plan, memory or simulate_plan(problem, plan))
    for found in _refreshing(problem, *lowest, deadline):
        if found[1].peak_bytes < lowest[1].peak_bytes:
            lowest = found
    return lowest


def _refreshing(problem: Problem, plan: Plan, memory: PlanMemory,
                deadline: float | None) -> Iterator[tuple[Plan, PlanMemory]]:
    """The pass's plans, one more storage refreshed each: the one that lowers the peak step's live
    bytes at the least added recompute time per byte, while one does (``MAX_REFRESHES`` at most)."""
    storages = refreshable_storages(problem, plan)
    for _ in range(MAX_REFRESHES):
        if memory.peak_phase != "backward" or (deadline is not None and clock.now() > deadline):
            return
        step = memory.backward_event_steps[memory.peak_index]
        best = None
        for storage in _held_at(problem, plan, memory, storages):
            if deadline is not None and clock.now() > deadline:  # a deep model's step simulates many trials
                return
            trial = dataclasses.replace(plan, refreshed=plan.refreshed | storages[storage])
            trial_memory = simulate_plan(problem, trial)
            saved = memory.step_peak(step) - trial_memory.step_peak(step)
            if saved <= 0 or trial_memory.peak_bytes > memory.peak_bytes:
                continue
            price = (trial.recompute_seconds - plan.recompute_seconds) / saved
            if best is None or price < best[0]:
                best = (price, trial, trial_memory)
        if best is None:
            return
        _, plan, memory = best
        logger.debug("refresh: peak %d at step %d after %d refreshed values", memory.peak_bytes, step,
                     len(plan.refreshed))
        yield plan, memory


def _held_at(problem: Problem, plan: Plan, memory: PlanMemory, storages: dict[int, frozenset[int]]) -> list[int]:
    """Refreshable storages held (not refreshed yet) at the peak event."""
    at = memory.peak_index
    values = problem.values
    found = set()
    for lifetime in backward_lifetimes(problem, plan)[1]:
        storage = values[lifetime.value].storage
        if (not lifetime.copy and lifetime.begin <= at <= lifetime.end and storage in storages
                and not storages[storage] & plan.refreshed):
            found.add(storage)
    return sorted(found)
