"""The Lagrangian oracle: for a multiplier, the best plan for ``seconds + lambda * bytes`` and its bound.

Identical blocks are cut once (``blocks``): the problem splits into groups that interact only
through values backward reads anyway (exactly separable) or through *coupling* values whose
presence in backward is enumerated in a small dynamic program over the groups in order; a group's
cut depends only on its signature and the states of its coupling values, so each distinct
(signature, states) pair is cut once per multiplier, whatever the depth. For a budget ``B``,
``mincut(lambda) - lambda * B`` is a lower bound on the optimum (Lagrangian duality).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

from ..mip.min_cut import BLOCKED, DOWN, NEEDED, RELAXED, Network, capacities
from ..analysis.graph_facts import relevant_values
from ..errors import SolverError
from ..problem import Problem, closure_from_keep_set
from .blocks import Decomposition

# Coupling values open at once in the dynamic program; more are fixed (see Oracle).
MAX_OPEN_COUPLINGS = 6


@dataclass(frozen=True)
class Point:
    """The best plan for ``seconds + lam * bytes`` and what it proves."""

    lam: float
    kept: frozenset[int]
    recomputed: frozenset[int]
    seconds: float
    nbytes: int
    lagrangian: float  # a lower bound on min over plans of (seconds + lam * bytes)
    group_keeps: tuple[frozenset[int], ...] = field(repr=False)

    def bound(self, budget_bytes: int) -> float:
        return self.lagrangian - self.lam * budget_bytes


class Oracle:
    """Evaluates the Lagrangian for a multiplier through the groups' cuts and a DP over couplings.

    The DP walks the groups in order; its state is the presence (NEEDED/BLOCKED) of the coupling
    values some earlier group touched and some later group still touches. With more than
    ``MAX_OPEN_COUPLINGS`` open at once, the longest-lived ones are fixed: NEEDED for plans (their
    owner provides them, always valid) and RELAXED for bounds (owner free, readers free: a
    relaxation, so still a valid lower bound).
    """

    def __init__(self, problem: Problem, split: Decomposition) -> None:
        self.problem = problem
        self.split = split
        self.relevant = relevant_values(problem)
        self.caps = capacities(problem, self.relevant)
        self.networks: dict[tuple[int, tuple[int, ...], bool], Network] = {}
        self.fixed = _fixed_couplings(split, MAX_OPEN_COUPLINGS)
        spans = {u: split.span(u) for u in split.couplings - self.fixed}
        self.opens = [[u for u, (first, _) in spans.items() if first == g] for g in range(len(split.groups))]
        self.last = {u: last for u, (_, last) in spans.items()}
        self.cuts = 0
        self.exact = self.caps.exact and not self.fixed

    def _cut(self, g: int, pattern: tuple[int, ...], lam: float, bound: bool,
             memo: dict) -> tuple[int, tuple[int, ...]] | None:
        cls = self.split.class_of[g]
        key = (cls, pattern, bound)
        if key not in memo:
            network = self.networks.get(key)
            if network is None:
                representative = self.split.groups[self.split.classes[cls][0]]
                network = Network(self.problem, self.caps, representative.members, representative.touched,
                                   pattern, bound)
                self.networks[key] = network
            memo[key] = network.cut(lam, self.caps.scale)
            self.cuts += 1
        return memo[key]

    def _dp(self, lam: float, bound: bool) -> tuple[int, list[tuple[int, ...]]] | None:
        """Min over coupling states of the groups' cut values; and each group's kept positions."""
        memo: dict = {}
        fixed_state = RELAXED if bound else NEEDED
        states: dict[tuple, tuple[int, tuple]] = {(): (0, ())}
        for g, group in enumerate(self.split.groups):
            opened = self.opens[g]
            following: dict[tuple, tuple[int, tuple]] = {}
            for assignment, (total, path) in states.items():
                known = dict(assignment)
                for bits in itertools.product((NEEDED, BLOCKED), repeat=len(opened)):
                    full = {**known, **dict(zip(opened, bits))}
                    pattern = tuple(full.get(u, fixed_state) for u in group.touched)
                    result = self._cut(g, pattern, lam, bound, memo)
                    if result is None:
                        continue
                    carried = tuple(sorted((u, b) for u, b in full.items() if self.last[u] > g))
                    candidate = total + result[0]
                    if carried not in following or candidate < following[carried][0]:
                        following[carried] = (candidate, (path, result[1]))
            states = following
            if not states:
                return None
        total, path = min(states.values(), key=operator.itemgetter(0))
        kept_positions: list[tuple[int, ...]] = []
        while path:
            path, positions = path
            kept_positions.append(positions)
        kept_positions.reverse()
        return total, kept_positions

    def evaluate(self, lam: float) -> Point:
        solved = self._dp(lam, bound=False)
        if solved is None:
            raise SolverError("the min-cut model found no plan at all; the problem record is inconsistent")
        units, positions = solved
        if not self.exact:
            relaxed = self._dp(lam, bound=True)
            units = relaxed[0] if relaxed is not None else 0
        group_keeps = tuple(
            frozenset(group.members[k] for k in kept) for group, kept in zip(self.split.groups, positions))
        return self.point(lam, group_keeps, lagrangian=units / self.caps.scale * DOWN)

    def point(self, lam: float, group_keeps: tuple[frozenset[int], ...], lagrangian: float) -> Point:
        kept, recomputed = closure_from_keep_set(self.problem, frozenset().union(*group_keeps))
        values = self.problem.values
        seconds = sum(values[i].recompute_seconds for i in recomputed)
        return Point(lam, kept, recomputed, seconds, self.problem.bytes_of(kept), lagrangian, group_keeps)


def _fixed_couplings(split: Decomposition, limit: int) -> frozenset[int]:
    """Coupling values to leave out of the DP so that at most ``limit`` are open at once."""
    spans = {u: split.span(u) for u in split.couplings}
    fixed: set[int] = set()
    for g in range(len(split.groups)):
        open_here = sorted((u for u, (a, b) in spans.items() if a <= g <= b and u not in fixed),
                           key=lambda u: spans[u][0] - spans[u][1])
        fixed.update(open_here[: max(len(open_here) - limit, 0)])
    return frozenset(fixed)

