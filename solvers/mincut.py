"""The fast planner: Lagrangian min-cuts over (identical) blocks, then a short warm-started ILP.

Without the budget row, keep/recompute is an s-t minimum cut (the construction of torch's min-cut
partitioner). Each forward value ``v`` becomes two nodes ``in_v -> out_v``:

* ``source -> in_v`` costs ``v``'s recompute time (infinite if it cannot be recomputed);
* ``in_v -> out_v`` costs ``lambda * bytes`` of its storage (infinite if it cannot be kept);
* ``out_u -> in_w`` is infinite for every input ``u`` of ``w``; ``out_v -> sink`` is infinite
  for every value backward reads.

A cut puts ``in_v`` on the sink side when ``v`` is recomputed, and separates ``in_v`` from
``out_v`` when it is kept. Views share their base's storage, which must be paid once however many
views are kept: a view that can be rebuilt from its base for free is never kept (keep the base,
recompute the view), so each storage has one edge carrying its bytes and the cut's value is
exactly ``recompute seconds + lambda * kept bytes`` (``exact``). A storage with two values that
must each be keepable (rare: a mutated alias) makes the model inexact; then plans come from a
network charging each such value fully and bounds from one charging each its share.

For a multiplier ``lambda`` the cut is the best plan for ``seconds + lambda * bytes``; sweeping it
traces the lower convex hull of the memory/recompute trade-off, and for a budget ``B``,
``mincut(lambda) - lambda * B`` is a lower bound on the optimum (Lagrangian duality), which is what
the reported gap is measured against. Between the two hull points around ``B``, plans mix the
per-block answers of both (``m`` blocks one way, the rest the other), and a time-limited ILP
warm-started from the best of them closes what it can of the remaining gap.

Identical blocks are cut once (``solvers.blocks``): the problem splits into groups that interact
only through values backward reads anyway (exactly separable) or through *coupling* values whose
presence in backward is enumerated in a small dynamic program over the groups in order; a
group's cut depends only on its signature and the states of its coupling values, so each distinct
(signature, states) pair is cut once per multiplier, whatever the depth.

Capacities are integers, rounded down, so every cut value is a valid lower bound; plans are
always evaluated exactly from their keep sets.

>>> from remat_pass.solvers.problem import Problem, Value
>>> x = Value(0, "x", (), storage=0, available=True)
>>> h = Value(1, "h", (0,), storage=1, recompute_seconds=1e-3)
>>> y = Value(2, "y", (1,), storage=2, recompute_seconds=2e-3)
>>> plan = solve_fast(Problem((x, h, y), (0, 100, 100), frozenset({1, 2})), budget_bytes=100)
>>> sorted(plan.recomputed), plan.status
([1], 'optimal')
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping

from . import baselines
from ._graph import effectively_recomputable, relevant_values
from .blocks import Decomposition, decompose
from .errors import BudgetInfeasibleError, SolverError
from .problem import Plan, Problem, Value, closure_from_keep_set

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT = 60.0
DEFAULT_POLISH_TIME_LIMIT = 3.0
DEFAULT_REFINE_TIME_LIMIT = 10.0
# The ILP polish is skipped above this many relevant values (the model alone takes seconds to build).
DEFAULT_POLISH_MAX_VALUES = 5000
# Coupling values open at once in the dynamic program; more are fixed (see _Oracle).
MAX_OPEN_COUPLINGS = 6
_CLOSED_GAP = 1e-9
# Capacities are scaled so the total recompute cost is about this many integer units.
_COST_UNITS = 2.0**40
_DOWN = 1.0 - 1e-12  # rounding capacities down absorbs float error in the products

NEEDED, BLOCKED, RELAXED = 1, 0, 2  # coupling states (see solvers.blocks)


# ----------------------------------------------------------------------------- the networks


@dataclass(frozen=True)
class _Capacities:
    """What each relevant value costs in a network: recompute seconds, bytes to keep it."""

    recomputable: tuple[bool, ...]
    keep_plan: Mapping[int, int]  # value -> bytes charged when kept (absent: never kept)
    keep_bound: Mapping[int, float]  # value -> its share of the storage (a lower bound)
    exact: bool
    scale: float  # integer units per second


def _capacities(problem: Problem, relevant: frozenset[int]) -> _Capacities:
    values, sizes = problem.values, problem.storage_bytes
    recomputable = effectively_recomputable(problem)
    keepers: dict[int, list[int]] = {}
    derived: set[int] = set()
    for v in sorted(relevant):
        value = values[v]
        if not value.keepable:
            continue
        storage = value.storage
        if sizes[storage] == 0:
            continue
        if storage in keepers and _rebuilt_from_storage(problem, v, storage, relevant, recomputable, keepers, derived):
            derived.add(v)
        else:
            keepers.setdefault(storage, []).append(v)
    keep_plan: dict[int, int] = {}
    keep_bound: dict[int, float] = {}
    exact = True
    for v in relevant:
        value = values[v]
        if not value.keepable or v in derived:
            continue
        nbytes = sizes[value.storage]
        keep_plan[v] = nbytes
        sharers = len(keepers.get(value.storage, ())) if nbytes else 1
        exact &= sharers <= 1
        keep_bound[v] = nbytes / max(sharers, 1)
    total = sum(values[v].recompute_seconds for v in relevant if recomputable[v])
    scale = _COST_UNITS / total if total > 0 else 1.0
    return _Capacities(recomputable, keep_plan, keep_bound, exact, scale)


def _rebuilt_from_storage(problem: Problem, v: int, storage: int, relevant: frozenset[int],
                          recomputable: tuple[bool, ...], keepers: Mapping[int, list[int]], derived: set[int]) -> bool:
    """Whether ``v`` (a later value of ``storage``) can be rebuilt for free from the storage's keeper.

    True for views: recomputable, zero cost, one non-available input that is an earlier value of
    the same storage, or a free tuple (``split``) of one. Keeping the base and recomputing such a
    view costs the same bytes and no time, so the network never keeps the view itself.
    """
    values = problem.values

    def free(u: int) -> bool:
        return recomputable[u] and values[u].recompute_seconds == 0

    def of_storage(u: int) -> bool:
        return values[u].storage == storage and u in relevant and (u in derived or u in keepers.get(storage, ()))

    if not free(v):
        return False
    sources = [u for u in values[v].inputs if not values[u].available]
    if len(sources) != 1:
        return False
    (u,) = sources
    if of_storage(u):
        return True
    if values[u].keepable or not free(u):
        return False
    inner = [w for w in values[u].inputs if not values[w].available]
    return len(inner) == 1 and of_storage(inner[0])


class _FlowGraph:
    """A flow network on integer nodes with paired residual edges (``e ^ 1`` is ``e``'s reverse).

    Dinic's algorithm, iterative (graphs can be deep); about 5x faster than networkx's
    Boykov-Kolmogorov on these graphs, which matters when a sweep runs hundreds of cuts.
    """

    __slots__ = ("size", "head", "to", "cap")

    def __init__(self, size: int) -> None:
        self.size = size
        self.head: list[list[int]] = [[] for _ in range(size)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add(self, u: int, v: int, capacity: float) -> int:
        edge = len(self.to)
        self.head[u].append(edge)
        self.to.append(v)
        self.cap.append(capacity)
        self.head[v].append(edge + 1)
        self.to.append(u)
        self.cap.append(0)
        return edge

    def min_cut(self, source: int, sink: int) -> tuple[int, list[bool]] | None:
        """(max-flow value, which nodes are on the source side), or None if every cut is infinite."""
        head, to, size = self.head, self.to, self.size
        cap = list(self.cap)
        total = 0
        while True:
            level = [-1] * size
            level[source] = 0
            queue = deque([source])
            while queue:
                u = queue.popleft()
                for e in head[u]:
                    if cap[e] > 0 and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        queue.append(to[e])
            if level[sink] < 0:
                break
            cursor = [0] * size
            while True:
                path: list[int] | None = []
                u = source
                while u != sink:
                    edges, i, wanted = head[u], cursor[u], level[u] + 1
                    while i < len(edges) and not (cap[edges[i]] > 0 and level[to[edges[i]]] == wanted):
                        i += 1
                    cursor[u] = i
                    if i < len(edges):
                        path.append(edges[i])
                        u = to[edges[i]]
                    elif u == source:
                        path = None
                        break
                    else:  # dead end: retreat
                        level[u] = -2
                        u = to[path.pop() ^ 1]
                        cursor[u] += 1
                if path is None:
                    break
                pushed = min(cap[e] for e in path)
                if pushed == _INFINITE:
                    return None
                for e in path:
                    cap[e] -= pushed
                    cap[e ^ 1] += pushed
                total += pushed
        reached = [False] * size
        reached[source] = True
        queue = deque([source])
        while queue:
            u = queue.popleft()
            for e in head[u]:
                if cap[e] > 0 and not reached[to[e]]:
                    reached[to[e]] = True
                    queue.append(to[e])
        return int(total), reached


_INFINITE = math.inf


class _Network:
    """One group's flow network for one assignment of coupling states; keep capacities set per lambda."""

    def __init__(self, problem: Problem, caps: _Capacities, members: tuple[int, ...], touched: tuple[int, ...],
                 pattern: tuple[int, ...], bound: bool) -> None:
        values = problem.values
        state = dict(zip(touched, pattern))
        position = {v: k for k, v in enumerate(members)}
        self.source, self.sink = 2 * len(members), 2 * len(members) + 1
        graph = _FlowGraph(2 * len(members) + 2)
        self.keep_edges: list[tuple[int, int, float]] = []  # (member position, edge, bytes)
        for k, v in enumerate(members):
            node_in, node_out = 2 * k, 2 * k + 1
            value = values[v]
            nbytes = (caps.keep_bound if bound else caps.keep_plan).get(v)
            edge = graph.add(node_in, node_out, _INFINITE if nbytes is None else 0)
            if nbytes is not None:
                self.keep_edges.append((k, edge, nbytes))
            blocked = False
            for u in set(value.inputs):
                if u in position:
                    graph.add(2 * position[u] + 1, node_in, _INFINITE)
                elif state.get(u) == BLOCKED:
                    blocked = True  # the input is not in backward: this value cannot be recomputed
            recompute = caps.recomputable[v] and not blocked
            graph.add(self.source, node_in,
                      int(value.recompute_seconds * caps.scale * _DOWN) if recompute else _INFINITE)
            if v in problem.backward_reads or state.get(v) == NEEDED:
                graph.add(node_out, self.sink, _INFINITE)
        self.graph = graph

    def cut(self, lam: float, scale: float) -> tuple[int, tuple[int, ...]] | None:
        """(cut value in units, member positions kept), or None when no finite cut exists."""
        cap = self.graph.cap
        for _, edge, nbytes in self.keep_edges:
            cap[edge] = int(lam * nbytes * scale * _DOWN)
        result = self.graph.min_cut(self.source, self.sink)
        if result is None:
            return None
        value, source_side = result
        kept = tuple(k for k, _, _ in self.keep_edges if source_side[2 * k] and not source_side[2 * k + 1])
        return value, kept


# ----------------------------------------------------------------------------- one multiplier


@dataclass(frozen=True)
class _Point:
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


class _Oracle:
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
        self.caps = _capacities(problem, self.relevant)
        self.networks: dict[tuple[int, tuple[int, ...], bool], _Network] = {}
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
                network = _Network(self.problem, self.caps, representative.members, representative.touched,
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

    def evaluate(self, lam: float) -> _Point:
        solved = self._dp(lam, bound=False)
        if solved is None:
            raise SolverError("the min-cut model found no plan at all; the problem record is inconsistent")
        units, positions = solved
        if not self.exact:
            relaxed = self._dp(lam, bound=True)
            units = relaxed[0] if relaxed is not None else 0
        group_keeps = tuple(
            frozenset(group.members[k] for k in kept) for group, kept in zip(self.split.groups, positions))
        return self.point(lam, group_keeps, lagrangian=units / self.caps.scale * _DOWN)

    def point(self, lam: float, group_keeps: tuple[frozenset[int], ...], lagrangian: float) -> _Point:
        kept, recomputed = closure_from_keep_set(self.problem, frozenset().union(*group_keeps))
        values = self.problem.values
        seconds = sum(values[i].recompute_seconds for i in recomputed)
        return _Point(lam, kept, recomputed, seconds, self.problem.bytes_of(kept), lagrangian, group_keeps)


def _fixed_couplings(split: Decomposition, limit: int) -> frozenset[int]:
    """Coupling values to leave out of the DP so that at most ``limit`` are open at once."""
    spans = {u: split.span(u) for u in split.couplings}
    fixed: set[int] = set()
    for g in range(len(split.groups)):
        open_here = sorted((u for u, (a, b) in spans.items() if a <= g <= b and u not in fixed),
                           key=lambda u: spans[u][0] - spans[u][1])
        fixed.update(open_here[: max(len(open_here) - limit, 0)])
    return frozenset(fixed)


# ----------------------------------------------------------------------------- the search


@dataclass
class _Search:
    """Hull points found so far around one budget."""

    oracle: _Oracle
    budget: int
    deadline: float
    lower_bound: float = -math.inf
    points: list[_Point] = field(default_factory=list)

    def at(self, lam: float) -> _Point:
        point = self.oracle.evaluate(lam)
        self.points.append(point)
        self.lower_bound = max(self.lower_bound, point.bound(self.budget))
        return point

    def bracket(self, low: _Point, high: _Point, max_steps: int = 200) -> tuple[_Point, _Point]:
        """Adjacent hull points with ``low`` over the budget and ``high`` within it (Eisner-Severance)."""
        for _ in range(max_steps):
            if time.perf_counter() > self.deadline:
                logger.info("fast: time limit reached while searching the hull")
                break
            lam = (high.seconds - low.seconds) / (low.nbytes - high.nbytes)
            if lam <= 0:
                break
            point = self.at(lam)
            line = low.seconds + lam * low.nbytes
            value = point.seconds + lam * point.nbytes
            if value >= line - 1e-12 * max(abs(line), 1e-30) or (point.nbytes, point.seconds) in (
                    (low.nbytes, low.seconds), (high.nbytes, high.seconds)):
                break
            if point.nbytes <= self.budget:
                high = point
            else:
                low = point
        return low, high


def _mixes(oracle: _Oracle, low: _Point, high: _Point, budget: int) -> list[_Point]:
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


# ----------------------------------------------------------------------------- refining groups


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
class _Config:
    """One way to plan a group: its kept positions, and what that costs inside the group."""

    positions: tuple[int, ...]
    nbytes: int
    seconds: float


def _refine(oracle: _Oracle, kept: frozenset[int], budget: int, deadline: float, *, max_values: int,
            backend: str, threads: int | None, sub_time_limit: float = 2.0) -> frozenset[int]:
    """Improve a fitting plan (given by its keep set) one bucket of identical groups at a time.

    A bucket is the groups of one signature whose coupling values stand alike in the plan; they
    have one sub-problem. Its budget is what the plan spends there plus the plan's slack; the
    sub-problem is solved exactly (ILP) at the even split of that budget and at a few uneven
    ones (``m`` groups get more), and the best assignment of at most two of the resulting
    configurations to the bucket's groups is kept if the whole plan gets cheaper. This is where
    the global budget is split across identical blocks; it also finds plans between hull points
    that no multiplier produces (the trade-off is not convex).
    """
    problem, split = oracle.problem, oracle.split
    current = oracle.point(0.0, (kept,), -math.inf)
    for _ in range(2):  # a second pass uses the slack the first one left
        improved = False
        for bucket in _buckets(oracle, current):
            if time.perf_counter() > deadline:
                return current.kept
            representative = split.groups[bucket[0]]
            if len(representative.members) > max_values:
                continue
            present = current.kept | current.recomputed
            sub, order = group_problem(problem, representative.members, present,
                                       _needed_outside(oracle, current.recomputed))
            index = {v: i for i, v in enumerate(order)}
            offset = len(order) - len(representative.members)
            spent = sum(problem.bytes_of(current.kept & set(split.groups[g].members)) for g in bucket)
            room = budget - current.nbytes + spent
            configs: dict[tuple[int, ...], _Config] = {}

            def add(local_kept: frozenset[int]) -> _Config | None:
                positions = tuple(sorted(i - offset for i in local_kept if i >= offset))
                if positions not in configs:
                    sub_kept, sub_recomputed = closure_from_keep_set(sub, {i + offset for i in positions})
                    configs[positions] = _Config(positions, sub.bytes_of(sub_kept),
                                                 sum(sub.values[i].recompute_seconds for i in sub_recomputed))
                return configs[positions]

            for g in bucket:
                members = split.groups[g].members
                add(frozenset(index[representative.members[k]] for k, v in enumerate(members) if v in current.kept))

            solved: dict[int, _Config] = {}  # budget -> the exact configuration for it

            def exact(share: int) -> _Config | None:
                left = deadline - time.perf_counter()
                if share < 0 or left <= 0.05:
                    return None
                below = max((b for b in solved if b <= share), default=None)
                above = min((b for b in solved if b >= share), default=None)
                if below is not None and above is not None and solved[below].seconds == solved[above].seconds:
                    return solved[below]  # the optimum is monotone in the budget: same between equal ends
                local_kept = _exact_keep(sub, share, min(sub_time_limit, left), backend, threads)
                if local_kept is None:
                    return None
                solved[share] = add(local_kept)
                return solved[share]

            count = len(bucket)
            even = exact(room // count)
            if even is not None and count > 1:
                # The exact trade-off of one group near the even share, then shares that let m groups
                # have more while the others take a cheaper configuration.
                for factor in _SHARES:
                    exact(int(room // count * factor))
                for low in sorted({c for c in configs.values() if c.nbytes <= even.nbytes}, key=lambda c: c.nbytes)[-3:]:
                    for m in _SPLITS:
                        if m < count:
                            exact((room - (count - m) * low.nbytes) // m)
            counts = _allocate(list(configs.values()), count, room, backend)
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
                logger.debug("fast: refined %s x%d: %.6g -> %.6g s", representative.name, count, current.seconds,
                             candidate.seconds)
                current = candidate
                improved = True
        if not improved:
            break
    return current.kept


def _exact_keep(problem: Problem, budget: int, time_limit: float, backend: str,
                threads: int | None) -> frozenset[int] | None:
    """The keep set of an optimal plan for a small problem (None: infeasible or not found in time).

    The ILP model with exact bytes and the plain recompute-time objective, one backend run; the
    caller evaluates what it returns, so neither a proof nor ``solve_ilp``'s extra runs are needed.
    """
    from ._mip import resolve_backend, run_mip
    from ._model import build, plan_from, rounding_for

    if budget >= problem.keep_all_bytes():
        return frozenset(baselines.keep_all(problem).kept)
    try:
        model = build(problem, rounding_for(problem, exact=True), budget, _time_weights(problem)[0])
        result = run_mip(model.lp, backend=resolve_backend(backend), time_limit=time_limit, threads=threads)
        if result.status not in ("optimal", "feasible"):
            return None
        plan = plan_from(problem, model, result, solver="fast")
    except SolverError:
        return None
    return plan.kept if plan.kept_bytes <= budget else None


def _time_weights(problem: Problem):
    """Objective weights that are recompute seconds over one unit (no tie-breaks), and that unit."""
    from ._model import Weights, paid_storage_bytes

    recomputable = effectively_recomputable(problem)
    costs = {v: problem.values[v].recompute_seconds for v in relevant_values(problem) if recomputable[v]}
    positive = [c for c in costs.values() if c > 0]
    unit = max(min(positive), sum(positive) / 1e6) if positive else 1.0
    weights = Weights(cost={v: c / unit for v, c in costs.items()},
                      storage={s: 0.0 for s in paid_storage_bytes(problem)})
    return weights, unit


# Shares of a bucket's budget (relative to the even split) at which one group is solved exactly.
_SHARES = (0.5, 0.75, 0.875, 0.9375, 1.0625, 1.125, 1.25, 1.5, 2.0)
# Numbers of groups given a larger share than the others when a bucket's budget is split.
_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _buckets(oracle: _Oracle, point: _Point) -> list[list[int]]:
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


def _needed_outside(oracle: _Oracle, recomputed: frozenset[int]) -> frozenset[int]:
    """Values another group's recomputation reads."""
    group_of, values = oracle.split.group_of, oracle.problem.values
    return frozenset(u for w in recomputed for u in values[w].inputs
                     if u in group_of and group_of[u] != group_of[w])


def _allocate(configs: list[_Config], count: int, room: int, backend: str) -> list[tuple[_Config, int]] | None:
    """How many of ``count`` identical groups take each configuration: least time within ``room`` bytes.

    A knapsack over a handful of configurations with multiplicities, solved exactly as a tiny
    integer program (the best two-configuration split when the backend fails).
    """
    from ._mip import resolve_backend, run_mip

    configs = [c for c in configs if c.nbytes * count <= room or c.nbytes <= room]
    if not configs:
        return None
    cheapest = min(configs, key=lambda c: c.nbytes)
    if cheapest.nbytes * count > room:
        return None
    best_pair = _best_pair(configs, count, room)
    if len(configs) <= 2 or count == 1:
        return best_pair
    try:
        import pulp

        lp = pulp.LpProblem("allocate", pulp.LpMinimize)
        numbers = [_integer(lp, f"n{i}", count) for i in range(len(configs))]
        scale = max(c.seconds for c in configs) or 1.0
        lp += pulp.lpSum(n * (c.seconds / scale) for n, c in zip(numbers, configs))
        lp += pulp.lpSum(numbers) == count
        lp += pulp.lpSum(n * c.nbytes for n, c in zip(numbers, configs)) <= room
        result = run_mip(lp, backend=resolve_backend(backend), time_limit=5.0)
    except Exception as error:  # only a refinement: the pair split stands
        logger.debug("fast: allocation MIP failed (%s); using the best pair", error)
        return best_pair
    if result.status not in ("optimal", "feasible"):
        return best_pair
    chosen = [(c, int(round(result.values.get(f"n{i}", 0.0)))) for i, c in enumerate(configs)]
    chosen = [(c, n) for c, n in chosen if n > 0]
    if sum(n for _, n in chosen) != count or sum(c.nbytes * n for c, n in chosen) > room:
        return best_pair
    pair_cost = sum(c.seconds * n for c, n in best_pair) if best_pair else math.inf
    return chosen if sum(c.seconds * n for c, n in chosen) <= pair_cost else best_pair


def _stale_highs_solution(lp, engine: str, result) -> bool:
    """Whether HiGHS's reported objective disagrees with the solution PuLP read back."""
    if engine != "highs" or result.objective is None or result.status not in ("optimal", "feasible"):
        return False
    try:
        reported = float(lp.solverModel.getInfo().objective_function_value)
    except (AttributeError, TypeError, ValueError):
        return False
    return abs(reported - result.objective) > 1e-6 * max(1.0, abs(reported))


def _integer(lp, name: str, upper: int):
    """An integer variable in [0, upper] owned by ``lp`` (PuLP 4 style where available)."""
    import pulp

    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, 0, upper, cat=pulp.LpInteger)
    return pulp.LpVariable(name, lowBound=0, upBound=upper, cat=pulp.LpInteger)


def _best_pair(configs: list[_Config], count: int, room: int) -> list[tuple[_Config, int]] | None:
    """The cheapest split giving ``m`` groups one configuration and the rest another."""
    best: tuple[float, list[tuple[_Config, int]]] | None = None
    for upper in configs:
        for lower in configs:
            if lower.nbytes > upper.nbytes or count * lower.nbytes > room:
                continue
            extra = upper.nbytes - lower.nbytes
            m = count if extra == 0 else min(count, (room - count * lower.nbytes) // extra)
            cost = m * upper.seconds + (count - m) * lower.seconds
            if best is None or cost < best[0]:
                best = (cost, [(upper, m), (lower, count - m)])
    return None if best is None else [(c, n) for c, n in best[1] if n > 0]


# ----------------------------------------------------------------------------- the ILP polish


def _polish(problem: Problem, budget: int, plan: Plan, time_limit: float, backend: str,
            threads: int | None) -> tuple[Plan, float | None]:
    """Run the ILP (exact bytes) from ``plan`` for at most ``time_limit``; (best plan, proven bound in seconds)."""
    from ._mip import resolve_backend, run_mip
    from ._model import build, fits, plan_from, rounding_for, start_values

    # Exact bytes (no coarser unit): a proof of this model is a proof for the real budget. No
    # tie-break terms: the objective is recompute seconds over `unit`, so its bound converts back.
    rounding = rounding_for(problem, exact=True)
    weights, unit = _time_weights(problem)
    engine = resolve_backend(backend)
    began = time.perf_counter()
    model = build(problem, rounding, budget, weights)
    start = start_values(model, plan) if fits(rounding, plan, budget) else None
    result = run_mip(model.lp, backend=engine, time_limit=max(time_limit, 0.05), threads=threads, start=start)
    if start is not None and _stale_highs_solution(model.lp, engine, result):
        # HiGHS (1.16) hands back the MIP start as its solution when presolve alone solves the
        # model, while its objective says otherwise; solve again without the start.
        logger.debug("fast: HiGHS returned the MIP start unchanged; solving again without it")
        model = build(problem, rounding, budget, weights)
        left = time_limit - (time.perf_counter() - began)
        result = run_mip(model.lp, backend=engine, time_limit=max(left, 0.05), threads=threads)
    best = plan
    if result.status in ("optimal", "feasible"):
        candidate = plan_from(problem, model, result, solver="fast", budget_bytes=budget)
        if candidate.kept_bytes <= budget and candidate.recompute_seconds < plan.recompute_seconds:
            best = candidate
    # Only the bound counts as proof: the model's optimum can miss the real budget by a few bytes
    # (integrality tolerance times large byte coefficients), and is then not taken.
    bound = result.bound * unit * _DOWN if result.bound is not None else None
    logger.debug("fast: ILP polish %s in %.2fs (bound %s)", result.status, result.seconds, bound)
    return best, bound


# ----------------------------------------------------------------------------- the planner


def solve_fast(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    blocks: bool = True,
    refine: bool = True,
    refine_time_limit: float = DEFAULT_REFINE_TIME_LIMIT,
    polish: bool | None = None,
    polish_time_limit: float = DEFAULT_POLISH_TIME_LIMIT,
    polish_max_values: int = DEFAULT_POLISH_MAX_VALUES,
    gap_target: float = _CLOSED_GAP,
    backend: str = "auto",
    threads: int | None = None,
) -> Plan:
    """The least recompute time keeping at most ``budget_bytes``, fast on deep models.

    Lagrangian min-cuts (shared across identical ``blocks``) give the hull of the trade-off and a
    proven lower bound; plans between the two hull points around the budget mix the blocks'
    answers. Then, unless the gap is within ``gap_target`` already: an ILP warm-started from the
    best plan runs for ``polish_time_limit`` seconds (``polish``: None = only for problems of at
    most ``polish_max_values`` relevant values, True = always, False = never), and if that did
    not prove it, ``refine`` improves the plan one bucket of identical groups at a time (exact
    sub-problems, the budget split across the bucket) for at most ``refine_time_limit`` seconds.
    ``time_limit`` bounds the whole call (seconds). The status is "optimal" only when the gap is
    closed (by the bound or an ILP proof); otherwise "feasible" with the gap to the best proven
    lower bound. Raises BudgetInfeasibleError below the smallest feasible budget, like "ilp";
    ``backend`` and ``threads`` go to the ILP runs.
    """
    began = time.perf_counter()
    deadline = began + time_limit
    if budget_bytes is not None:
        budget_bytes = operator.index(budget_bytes)
    keep_all = problem.keep_all_bytes()
    if budget_bytes is None or budget_bytes >= keep_all:
        plan = baselines.keep_all(problem, budget_bytes)
        return _finish(plan, "optimal", 0.0, began, budget_bytes)
    oracle = _Oracle(problem, decompose(problem, blocks=blocks))
    search = _Search(oracle, budget_bytes, deadline)
    values = problem.values
    costs = [values[v].recompute_seconds for v in oracle.relevant if oracle.caps.recomputable[v]]
    positive = [c for c in costs if c > 0]
    low = search.at(min(positive) / (4 * max(keep_all, 1)) if positive else 1e-30)
    if low.nbytes <= budget_bytes:
        # The least recompute time of all fits. Proven by the cost-only cut (multiplier 0), which
        # bounds every budget, unless rounding hid a cost difference.
        search.at(0.0)
        gap = _gap(low.seconds, search.lower_bound)
        status = "optimal" if gap <= _CLOSED_GAP else "feasible"
        return _finish(_plan_of(problem, low), status, 0.0 if status == "optimal" else gap, began, budget_bytes)
    high = search.at(2 * (sum(costs) + (min(positive) if positive else 1.0)))
    if high.nbytes > budget_bytes:
        smallest = high.nbytes if oracle.exact else _exact_min_bytes(problem, deadline, backend, threads)
        if smallest > budget_bytes:
            raise BudgetInfeasibleError(budget_bytes, smallest, keep_all)
        logger.info("fast: the inexact min-cut model missed a plan the ILP finds; using the ILP")
        from .ilp import solve_ilp

        plan = solve_ilp(problem, budget_bytes, time_limit=max(deadline - time.perf_counter(), 1.0), backend=backend,
                         threads=threads)
        return _finish(plan, plan.status, plan.gap, began, budget_bytes)
    low, high = search.bracket(low, high)
    candidates = [high, *_mixes(oracle, low, high, budget_bytes)]
    best = min((c for c in candidates if c.nbytes <= budget_bytes), key=lambda c: (c.seconds, c.nbytes))
    lower = search.lower_bound
    plan = _plan_of(problem, best)
    gap = _gap(plan.recompute_seconds, lower)
    proven = False
    # Small problems: the whole ILP from the best plan is quick and may prove it. Deep ones: refine
    # bucket by bucket (small exact sub-problems with the budget split across identical blocks).
    if polish if polish is not None else len(oracle.relevant) <= polish_max_values:
        left = deadline - time.perf_counter()
        if gap > gap_target and left > 0.05:
            plan, ilp_bound = _polish(problem, budget_bytes, plan, min(polish_time_limit, left), backend, threads)
            if ilp_bound is not None:
                lower = max(lower, ilp_bound)
            gap = _gap(plan.recompute_seconds, lower)
            proven = gap <= _CLOSED_GAP
    if refine and not proven and gap > gap_target and deadline - time.perf_counter() > 0.05:
        kept = _refine(oracle, plan.kept, budget_bytes, min(deadline, time.perf_counter() + refine_time_limit),
                       max_values=polish_max_values, backend=backend, threads=threads)
        refined = oracle.point(0.0, (kept,), -math.inf)
        if refined.seconds < plan.recompute_seconds:
            plan = _plan_of(problem, refined)
            gap = _gap(plan.recompute_seconds, lower)
    status = "optimal" if proven or gap <= _CLOSED_GAP else "feasible"
    logger.info("fast: %d groups, %d classes, %d cuts, %d hull points; budget %d B, kept %d B, recompute %.6g s, "
                "%s, gap %.3g, %.3fs", len(oracle.split.groups), len(oracle.split.classes), oracle.cuts,
                len(search.points), budget_bytes, plan.kept_bytes, plan.recompute_seconds, status, gap,
                time.perf_counter() - began)
    return _finish(plan, status, 0.0 if status == "optimal" else gap, began, budget_bytes)


def _exact_min_bytes(problem: Problem, deadline: float, backend: str, threads: int | None) -> int:
    from .ilp import min_feasible_bytes

    return min_feasible_bytes(problem, time_limit=max(deadline - time.perf_counter(), 10.0), backend=backend,
                              threads=threads)


def _gap(seconds: float, bound: float) -> float:
    if seconds <= 0:
        return 0.0
    return max(0.0, (seconds - bound) / seconds)


def _plan_of(problem: Problem, point: _Point) -> Plan:
    return Plan(problem=problem, kept=point.kept, recomputed=point.recomputed, solver="fast", status="feasible",
                gap=None)


def _finish(plan: Plan, status: str, gap: float | None, began: float, budget_bytes: int | None) -> Plan:
    if budget_bytes is not None and plan.kept_bytes > budget_bytes:
        raise SolverError(f"fast plan keeps {plan.kept_bytes} bytes, over the budget of {budget_bytes}; this is a bug")
    return Plan(problem=plan.problem, kept=plan.kept, recomputed=plan.recomputed, solver="fast", status=status,
                gap=gap, solve_seconds=time.perf_counter() - began, budget_bytes=budget_bytes)


# ----------------------------------------------------------------------------- the whole curve


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
    oracle = _Oracle(problem, decompose(problem, blocks=blocks))
    deadline = time.perf_counter() + time_limit
    values = problem.values
    costs = [values[v].recompute_seconds for v in oracle.relevant if oracle.caps.recomputable[v]]
    positive = [c for c in costs if c > 0]
    keep_all = problem.keep_all_bytes()
    first = oracle.evaluate(min(positive) / (4 * max(keep_all, 1)) if positive else 1e-30)
    last = oracle.evaluate(2 * (sum(costs) + (min(positive) if positive else 1.0)))
    found = {(first.nbytes, first.seconds): first, (last.nbytes, last.seconds): last}
    stack = [(first, last)]
    while stack and time.perf_counter() < deadline:
        left, right = stack.pop()
        if left.nbytes <= right.nbytes:
            continue
        lam = (right.seconds - left.seconds) / (left.nbytes - right.nbytes)
        if lam <= 0:
            continue
        point = oracle.evaluate(lam)
        line = left.seconds + lam * left.nbytes
        if point.seconds + lam * point.nbytes >= line - 1e-12 * max(abs(line), 1e-30):
            continue
        found.setdefault((point.nbytes, point.seconds), point)
        stack += [(left, point), (point, right)]
    cheapest: dict[int, _Point] = {}  # per byte count, the least time (a min-bytes cut need not be it)
    for point in found.values():
        if point.nbytes not in cheapest or point.seconds < cheapest[point.nbytes].seconds:
            cheapest[point.nbytes] = point
    hull: list[_Point] = []
    for point in sorted(cheapest.values(), key=lambda p: p.nbytes):  # the lower hull, bytes ascending
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) <= 0:
            hull.pop()
        if hull and point.seconds >= hull[-1].seconds:
            continue  # more bytes for no less time: not on the trade-off
        hull.append(point)
    values = problem.values
    return [HullPoint(p.nbytes, p.seconds, p.lam, sum(values[i].flops for i in p.recomputed)) for p in reversed(hull)]


def _turn(o: _Point, a: _Point, b: _Point) -> float:
    """Positive when o -> a -> b turns counter-clockwise in the (bytes, seconds) plane."""
    return (a.nbytes - o.nbytes) * (b.seconds - o.seconds) - (a.seconds - o.seconds) * (b.nbytes - o.nbytes)


__all__ = ["HullPoint", "solve_fast", "tradeoff_hull"]
