"""Structural facts about a Problem that several planners need.

Kept apart from ``problem.py`` because they are derived views, not part of the contract:
each is recomputed from the frozen record on demand.
"""

from __future__ import annotations

from typing import Iterable

from ..problem import Problem


def relevant_values(problem: Problem) -> frozenset[int]:
    """Non-available values backward could ever need: the reads and their ancestors.

    Anything else is never kept nor recomputed by any plan, so models can leave it out.
    """
    values = problem.values
    seen: set[int] = set()
    stack = [i for i in problem.backward_reads if not values[i].available]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(u for u in values[i].inputs if not values[u].available and u not in seen)
    return frozenset(seen)


def effectively_recomputable(problem: Problem) -> tuple[bool, ...]:
    """Whether each value can really be recomputed in backward.

    ``Value.recomputable`` is a local flag; a recomputable ``getitem`` of a random tuple op is
    still stuck, because its input can be neither kept (a tuple) nor recomputed (random).
    A value is recomputable in effect when every input can be had some way: available,
    keepable, or itself recomputable in effect.
    """
    result: list[bool] = []
    for value in problem.values:
        obtainable = all(
            problem.values[u].available or problem.values[u].keepable or result[u] for u in value.inputs
        )
        result.append(value.recomputable and not value.available and obtainable)
    return tuple(result)


def forced_keeps(problem: Problem) -> frozenset[int]:
    """Keepable, non-available values that must be kept whenever backward needs them."""
    recomputable = effectively_recomputable(problem)
    return frozenset(
        v.id for v in problem.values if v.keepable and not v.available and not recomputable[v.id]
    )


def storages_of(problem: Problem, value_ids: Iterable[int]) -> frozenset[int]:
    """Storages that keeping these values would pay for (0-byte ones are free)."""
    return frozenset(
        s for s in (problem.values[i].storage for i in value_ids) if problem.storage_bytes[s] > 0
    )
