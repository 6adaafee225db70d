"""Refining a fitting plan one bucket of identical groups at a time, with exact sub-problems.

This is where the global budget is split across identical blocks: each bucket's groups share one
sub-problem (``group_problem``), solved exactly at a few shares of the bucket's bytes, and
``allocate`` picks how many groups take each answer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from .. import clock
from ..problem import Problem, Value, closure_from_keep_set
from .allocate import Config, allocate
from .oracle import Oracle, Point
from .polish import exact_keep

logger = logging.getLogger(__name__)

# Shares of a bucket's budget (relative to the even split) at which one group is solved exactly.
SHARES = (0.5, 0.75, 0.875, 0.9375, 1.0625, 1.125, 1.25, 1.5, 2.0)
# Numbers of groups given a larger share than the others when a bucket's budget is split.
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def group_problem(problem: Problem, members: tuple[int, ...], present: frozenset[int],
                  needed: frozenset[int]) -> tuple[Problem, tuple[int, ...]]:
    """One group as a Problem of its own, and the global id of each of its values.

    Inputs from other groups come first: available when backward has them anyway (available,
    read by backward, or in ``present``: kept or recomputed by the plan in force), otherwise
    values that can be neither kept nor recomputed (so nothing reading them can be recomputed).
    The group's values follow, with their storages; backward reads those it reads globally and
    those in ``needed`` (read by another group's recomputation).
    """
    values, sizes = problem.values, problem.storage_bytes
    inside = set(members)
    outside = sorted({u for v in members for u in values[v].inputs if u not in inside})
    order = (*outside, *members)
    local = {v: i for i, v in enumerate(order)}
    storage_of: dict[int, int] = {}
    storage_bytes = [0]
    rebuilt: list[Value] = []
    for i, v in enumerate(order):
        value = values[v]
        if v not in inside:
            free = value.available or v in problem.backward_reads or v in present
            rebuilt.append(Value(i, value.name, (), storage=0, available=free, keepable=False, recomputable=False,
                                 module=value.module, op=value.op))
            continue
        if value.storage not in storage_of:
            storage_of[value.storage] = len(storage_bytes)
            storage_bytes.append(sizes[value.storage])
        rebuilt.append(replace(value, id=i, inputs=tuple(local[u] for u in value.inputs),
                               storage=storage_of[value.storage]))
    reads = frozenset(local[v] for v in members if v in problem.backward_reads or v in needed)
    return Problem(tuple(rebuilt), tuple(storage_bytes), reads, device=problem.device), order


@dataclass(frozen=True)
class _Solving:
    """How the sub-problems are solved: the shared deadline and the backend."""

    deadline: float
    backend: str
    threads: int | None
    sub_time_limit: float


class _Bucket:
    """One bucket's sub-problem, and the configurations (ways to plan one group) found for it."""

    def __init__(self, oracle: Oracle, current: Point, bucket: list[int], solving: _Solving) -> None:
        problem, split = oracle.problem, oracle.split
        self.representative = split.groups[bucket[0]]
        members = self.representative.members
        self.sub, order = group_problem(problem, members, current.kept | current.recomputed,
                                        _needed_outside(oracle, current.recomputed))
        self.offset = len(order) - len(members)
        self.solving = solving
        self.configs: dict[tuple[int, ...], Config] = {}
        self.solved: dict[int, Config] = {}  # budget -> the exact configuration for it
        index = {v: i for i, v in enumerate(order)}
        for g in bucket:  # what the plan in force does in each group
            self.add(frozenset(index[members[k]] for k, v in enumerate(split.groups[g].members) if v in current.kept))

    def add(self, local_kept: frozenset[int]) -> Config:
        positions = tuple(sorted(i - self.offset for i in local_kept if i >= self.offset))
        if positions not in self.configs:
            sub = self.sub
            sub_kept, sub_recomputed = closure_from_keep_set(sub, {i + self.offset for i in positions})
            self.configs[positions] = Config(positions, sub.bytes_of(sub_kept),
                                             sum(sub.values[i].recompute_seconds for i in sub_recomputed))
        return self.configs[positions]

    def exact(self, share: int) -> Config | None:
        """The optimal configuration of one group within ``share`` bytes (None: none, or no time)."""
        left = self.solving.deadline - clock.now()
        if share < 0 or left <= 0.05:
            return None
        solved = self.solved
        below = max((b for b in solved if b <= share), default=None)
        above = min((b for b in solved if b >= share), default=None)
        if below is not None and above is not None and solved[below].seconds == solved[above].seconds:
            return solved[below]  # the optimum is monotone in the budget: same between equal ends
        local_kept = exact_keep(self.sub, share, min(self.solving.sub_time_limit, left), self.solving.backend,
                                self.solving.threads)
        if local_kept is None:
            return None
        solved[share] = self.add(local_kept)
        return solved[share]

    def explore(self, count: int, room: int) -> None:
        """Exact configurations at the even share, near it, and at shares that favour ``m`` groups."""
        even = self.exact(room // count)
        if even is None or count == 1:
            return
        for factor in SHARES:
            self.exact(int(room // count * factor))
        cheaper = sorted({c for c in self.configs.values() if c.nbytes <= even.nbytes}, key=lambda c: c.nbytes)
        for low in cheaper[-3:]:
            for m in SPLITS:
                if m < count:
                    self.exact((room - (count - m) * low.nbytes) // m)


def refine(oracle: Oracle, kept: frozenset[int], budget: int, deadline: float, *, max_values: int,
           backend: str, threads: int | None, sub_time_limit: float = 2.0) -> frozenset[int]:
    """Improve a fitting plan (given by its keep set) one bucket of identical groups at a time.

    A bucket is the groups of one signature whose coupling values stand alike in the plan; they
    have one sub-problem. Its budget is what the plan spends there plus the plan's slack; the
    sub-problem is solved exactly (ILP) at the even split of that budget and at a few uneven
    ones (``m`` groups get more), and the best assignment of the resulting configurations to the
    bucket's groups is kept if the whole plan gets cheaper. This is where the global budget is
    split across identical blocks; it also finds plans between hull points that no multiplier
    produces (the trade-off is not convex).
    """
    problem, split = oracle.problem, oracle.split
    solving = _Solving(deadline, backend, threads, sub_time_limit)
    current = oracle.point(0.0, (kept,), -math.inf)
    for _ in range(2):  # a second pass uses the slack the first one left
        improved = False
        for bucket in _buckets(oracle, current):
            if clock.now() > deadline:
                return current.kept
            if len(split.groups[bucket[0]].members) > max_values:
                continue
            found = _Bucket(oracle, current, bucket, solving)
            spent = sum(problem.bytes_of(current.kept & set(split.groups[g].members)) for g in bucket)
            room = budget - current.nbytes + spent
            found.explore(len(bucket), room)
            counts = allocate(list(found.configs.values()), len(bucket), room)
            if counts is None:
                continue
            assigned = [config for config, n in counts for _ in range(n)]
            keeps = set(current.kept)
            for config, g in zip(assigned, bucket):
                members = split.groups[g].members
                keeps -= set(members)
                keeps |= {members[k] for k in config.positions}
            candidate = oracle.point(0.0, (frozenset(keeps),), -math.inf)
            if candidate.nbytes <= budget and candidate.seconds < current.seconds * (1 - 1e-12):
                logger.debug("fast: refined %s x%d: %.6g -> %.6g s", found.representative.name, len(bucket),
                             current.seconds, candidate.seconds)
                current = candidate
                improved = True
        if not improved:
            break
    return current.kept


def _buckets(oracle: Oracle, point: Point) -> list[list[int]]:
    """Groups with one signature and alike coupling states, costliest recomputation first."""
    split, values = oracle.split, oracle.problem.values
    present = point.kept | point.recomputed
    needed = _needed_outside(oracle, point.recomputed)
    found: dict[tuple, list[int]] = {}
    for g, group in enumerate(split.groups):
        inside = set(group.members)
        states = tuple((u in needed) if u in inside else (u in present) for u in group.touched)
        found.setdefault((split.class_of[g], states), []).append(g)

    def weight(bucket: list[int]) -> float:
        return -sum(values[v].recompute_seconds for g in bucket for v in split.groups[g].members
                    if v in point.recomputed)

    return sorted(found.values(), key=weight)


def _needed_outside(oracle: Oracle, recomputed: frozenset[int]) -> frozenset[int]:
    """Values another group's recomputation reads."""
    group_of, values = oracle.split.group_of, oracle.problem.values
    return frozenset(u for w in recomputed for u in values[w].inputs
                     if u in group_of and group_of[u] != group_of[w])


