"""When each value of a plan lives: what forward computes, and every backward lifetime in run order.

The event order that the peak model (``memory``) prices in bytes and the host link model
(``transfers``) schedules transfers against; split from ``memory`` so that the two import it and
not each other. Backward runs its steps in order; before step ``i`` every recomputed value it
needs is materialized, inputs first; a held recomputed value lives until its last use, a
refreshed one (``Plan.refreshed``) is made again in every step that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..problem import ANALYSES, BackwardStep, Plan, Problem


def backward_steps_of(problem: Problem) -> tuple[BackwardStep, ...]:
    """The problem's backward steps; for a hand-made problem without steps, one step per value
    backward reads, latest value first (backward runs in reverse), with no working set."""
    if not problem.backward_steps:
        return tuple(BackwardStep((v,), 0) for v in sorted(problem.backward_reads, reverse=True))
    return problem.backward_steps


def forward_computed(problem: Problem, kept: frozenset[int]) -> list[int]:
    """Values the forward graph computes: ancestors of its outputs and of kept values."""
    wanted = set(problem.forward_outputs) | set(kept)
    stack = list(wanted)
    while stack:
        for source in problem.values[stack.pop()].inputs:
            if source not in wanted:
                wanted.add(source)
                stack.append(source)
    return sorted(i for i in wanted if not problem.values[i].available)


@dataclass(frozen=True)
class _Event:
    """A point in backward: materializing a recomputed value, or running backward step ``step``."""

    step: int
    value: int | None  # the value materialized; None for the step's own op


@dataclass(frozen=True)
class Lifetime:
    """One tensor of ``value`` in backward: alive from event ``begin`` (-1: from the forward)
    through event ``end``. A refreshed value has one per backward step that materializes it."""

    value: int
    begin: int
    end: int
    copy: bool = False  # a refreshed value's copy, made and freed within one step


def backward_lifetimes(problem: Problem, plan: Plan) -> tuple[list[_Event], list[Lifetime]]:
    """Events in run order and every backward lifetime of the values backward uses.

    Before step ``i`` runs, every recomputed value it needs (directly or through other
    recomputed values) is materialized, inputs first; a value used only by such
    materializations dies before step ``i`` itself runs. A held recomputed value is made once
    and lives until its last use; a refreshed one (``Plan.refreshed``) is made again in every
    step that needs it and freed at the end of that step.
    """
    values = problem.values
    events: list[_Event] = []
    held: dict[int, int] = {}
    open_: dict[int, list[int]] = {}  # value -> [begin, end] of its current tensor
    lifetimes: list[Lifetime] = []
    unpacked = _unpacked_together(problem, plan)
    for step_index, step in enumerate(backward_steps_of(problem)):
        fresh: list[int] = []
        for v in _needed_in_order(problem, plan, step.reads, held, unpacked):
            at = len(events)
            events.append(_Event(step_index, v))
            if v in plan.refreshed:
                fresh.append(v)
            else:
                held[v] = at
            open_[v] = [at, at]
            for u in values[v].inputs:
                if not values[u].available:
                    open_.setdefault(u, [-1, at])[1] = at
        op = len(events)
        events.append(_Event(step_index, None))
        for v in step.reads:
            if not values[v].available:
                open_.setdefault(v, [-1, op])[1] = op
        for v in fresh:
            begin, end = open_.pop(v)
            lifetimes.append(Lifetime(v, begin, end, copy=True))
    lifetimes += [Lifetime(v, begin, end) for v, (begin, end) in open_.items()]
    return events, lifetimes


def materializations(problem: Problem, plan: Plan) -> dict[int, int]:
    """How many times backward makes each recomputed value: once, or (refreshed) once per step
    that needs it; a refreshed value no step needs is made 0 times."""
    counts = {v: 1 for v in plan.recomputed if v not in plan.refreshed}
    if plan.refreshed:
        counts.update({v: 0 for v in plan.refreshed})
        for lifetime in backward_lifetimes(problem, plan)[1]:
            if lifetime.copy:
                counts[lifetime.value] += 1
    return counts


def _needed_in_order(problem: Problem, plan: Plan, reads: tuple[int, ...], done: dict[int, int],
                     unpacked: dict[int, list[int]] | None = None) -> list[int]:
    """Recomputed values not yet materialized that ``reads`` depend on, in topological order;
    with a recomputed tuple come its elements in ``unpacked`` (see ``_unpacked_together``)."""
    values = problem.values
    needed: set[int] = set()
    stack = [v for v in reads if v in plan.recomputed and v not in done]
    while stack:
        v = stack.pop()
        if v in needed:
            continue
        needed.add(v)
        stack.extend(u for u in values[v].inputs if u in plan.recomputed and u not in done and u not in needed)
        stack.extend(u for u in (unpacked or {}).get(v, ()) if u not in done and u not in needed)
    return sorted(needed)


def _unpacked_together(problem: Problem, plan: Plan) -> dict[int, list[int]]:
    """Per recomputed tuple (a multi-output op), its recomputed elements that backward uses.

    The rewrite unpacks a recomputed tuple right after making it (FX code would otherwise hold
    every element until the tuple's last ``getitem``), so an element read late in backward
    (BatchNorm's saved statistics) is materialized with the tuple, not at its first reader.
    """
    reads = tuple(sorted({v for step in backward_steps_of(problem) for v in step.reads}))
    used = _needed_in_order(problem, plan, reads, {})
    unpacked: dict[int, list[int]] = {}
    for v in used:
        value = problem.values[v]
        if value.op == "getitem" and len(value.inputs) == 1 and value.inputs[0] in plan.recomputed:
            unpacked.setdefault(value.inputs[0], []).append(v)
    return unpacked


def read_spans(problem: Problem) -> tuple[dict[int, int], dict[int, int]]:
    """First and last backward step that reads each value directly."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for index, step in enumerate(backward_steps_of(problem)):
        for v in step.reads:
            first.setdefault(v, index)
            last[v] = index
    return first, last


ANALYSES["materializations"] = materializations  # Plan.recompute_seconds counts refreshed values with it
