"""The lower convex hull of the memory/recompute trade-off, found one multiplier at a time.

For a multiplier ``lambda`` the oracle's cut is the best plan for ``seconds + lambda * bytes``:
a vertex of the hull. Given two vertices, the multiplier of the line through them either finds
a vertex below that line or proves the edge is on the hull (Eisner-Severance). ``HullSearch``
does this one way for both users: the planner follows only the edge around its budget
(``bracket``), ``tradeoff_hull`` every edge (``vertices``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .. import clock
from ..problem import Problem
from ..status import DEFAULT_TIME_LIMIT
from .blocks import decompose
from .oracle import Oracle, Point

logger = logging.getLogger(__name__)


def extreme_multipliers(oracle: Oracle) -> tuple[float, float]:
    """A multiplier so small its cut keeps the most bytes, and one so large it keeps the fewest."""
    values = oracle.problem.values
    costs = [values[v].recompute_seconds for v in oracle.relevant if oracle.caps.recomputable[v]]
    positive = [c for c in costs if c > 0]
    keep_all = oracle.problem.keep_all_bytes()
    low = min(positive) / (4 * max(keep_all, 1)) if positive else 1e-30
    high = 2 * (sum(costs) + (min(positive) if positive else 1.0))
    return low, high


@dataclass
class HullSearch:
    """Hull vertices found so far (every oracle call, in order) and the time they may take."""

    oracle: Oracle
    deadline: float
    points: list[Point] = field(default_factory=list)

    def at(self, lam: float) -> Point:
        point = self.oracle.evaluate(lam)
        self.points.append(point)
        return point

    def lower_bound(self, budget: int) -> float:
        """The best Lagrangian bound for ``budget`` among the points seen."""
        return max((p.bound(budget) for p in self.points), default=-math.inf)

    def split(self, left: Point, right: Point) -> Point | None:
        """A vertex strictly below the edge ``left`` (more bytes) to ``right``; None if the edge is on the hull."""
        if left.nbytes <= right.nbytes:
            return None
        lam = (right.seconds - left.seconds) / (left.nbytes - right.nbytes)
        if lam <= 0:
            return None
        point = self.at(lam)
        line = left.seconds + lam * left.nbytes
        if point.seconds + lam * point.nbytes >= line - 1e-12 * max(abs(line), 1e-30):
            return None
        if (point.nbytes, point.seconds) in ((left.nbytes, left.seconds), (right.nbytes, right.seconds)):
            return None
        return point

    def bracket(self, low: Point, high: Point, budget: int, max_steps: int = 200) -> tuple[Point, Point]:
        """Adjacent hull vertices with ``low`` over the budget and ``high`` within it."""
        for _ in range(max_steps):
            if clock.now() > self.deadline:
                logger.info("fast: time limit reached while searching the hull")
                break
            point = self.split(low, high)
            if point is None:
                break
            if point.nbytes <= budget:
                high = point
            else:
                low = point
        return low, high

    def vertices(self, first: Point, last: Point) -> list[Point]:
        """Every vertex between ``first`` and ``last`` (within the deadline), by bytes ascending."""
        stack = [(first, last)]
        while stack and clock.now() < self.deadline:
            left, right = stack.pop()
            point = self.split(left, right)
            if point is not None:
                stack += [(left, point), (point, right)]
        cheapest: dict[int, Point] = {}  # per byte count, the least time (a min-bytes cut need not be it)
        for point in self.points:
            if point.nbytes not in cheapest or point.seconds < cheapest[point.nbytes].seconds:
                cheapest[point.nbytes] = point
        hull: list[Point] = []
        for point in sorted(cheapest.values(), key=lambda p: p.nbytes):
            while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) <= 0:
                hull.pop()
            if hull and point.seconds >= hull[-1].seconds:
                continue  # more bytes for no less time: not on the trade-off
            hull.append(point)
        return hull


def _turn(o: Point, a: Point, b: Point) -> float:
    """Positive when o -> a -> b turns counter-clockwise in the (bytes, seconds) plane."""
    return (a.nbytes - o.nbytes) * (b.seconds - o.seconds) - (a.seconds - o.seconds) * (b.nbytes - o.nbytes)


def mixes(oracle: Oracle, low: Point, high: Point, budget: int) -> list[Point]:
    """Plans taking the first ``m`` groups from one point and the rest from the other.

    With identical blocks, ``m`` blocks keeping more and ``n - m`` keeping less fill the gap
    between the two hull points in steps of one block. The closure keeps every mix valid; for
    each order the ``m`` closest to ``low`` that still fits is found by bisection on bytes.
    """
    found = []
    count = len(oracle.split.groups)
    for first, second in ((low, high), (high, low)):
        left, right, best = 0, count, None
        while left <= right:
            m = (left + right) // 2
            candidate = oracle.point(low.lam, first.group_keeps[:m] + second.group_keeps[m:], -math.inf)
            fits = candidate.nbytes <= budget
            if fits and (best is None or candidate.seconds < best.seconds):
                best = candidate
            # Moving m towards `low` saves recompute time and costs bytes.
            towards_low = fits if first is low else not fits
            if towards_low:
                left = m + 1
            else:
                right = m - 1
        if best is not None:
            found.append(best)
    return found


@dataclass(frozen=True)
class HullPoint:
    """A vertex of the lower convex hull of (kept bytes, recompute seconds): optimal for its bytes."""

    kept_bytes: int
    recompute_seconds: float
    multiplier: float
    recompute_flops: int = 0


def tradeoff_hull(problem: Problem, *, blocks: bool = True, time_limit: float = DEFAULT_TIME_LIMIT) -> list[HullPoint]:
    """Every vertex of the memory/recompute hull, from keep-all to the fewest bytes (by bytes, descending).

    Each vertex is an optimal plan for its own byte count (when the model is exact); between
    vertices the hull is a lower bound. One cut per vertex and one per hull edge.
    """
    oracle = Oracle(problem, decompose(problem, blocks=blocks))
    search = HullSearch(oracle, clock.now() + time_limit)
    low, high = extreme_multipliers(oracle)
    hull = search.vertices(search.at(low), search.at(high))
    values = problem.values
    return [HullPoint(p.nbytes, p.seconds, p.lam,
                      sum(values[i].flops for i in p.recomputed)) for p in reversed(hull)]
