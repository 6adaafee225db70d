"""Keep/recompute without the budget row is an s-t minimum cut: the networks, and Dinic's max-flow.

Used by the fast planner (one network per group of values, ``solvers.fast``) and, with free
recomputes and byte capacities, for the exact fewest bytes a plan can keep (``min_bytes_cut``).

Each forward value ``v`` becomes two nodes ``in_v -> out_v``:

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

Capacities are integers, rounded down, so every cut value is a valid lower bound.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping

from ..analysis.graph_facts import effectively_recomputable, relevant_values
from ..problem import Problem

# Capacities are scaled so the total recompute cost is about this many integer units.
COST_UNITS = 2.0**40
DOWN = 1.0 - 1e-12  # rounding capacities down absorbs float error in the products

NEEDED, BLOCKED, RELAXED = 1, 0, 2  # coupling states (see solvers.fast.blocks)
INFINITE = math.inf



@dataclass(frozen=True)
class Capacities:
    """What each relevant value costs in a network: recompute seconds, bytes to keep it."""

    recomputable: tuple[bool, ...]
    keep_plan: Mapping[int, int]  # value -> bytes charged when kept (absent: never kept)
    keep_bound: Mapping[int, float]  # value -> its share of the storage (a lower bound)
    exact: bool
    scale: float  # integer units per second


def capacities(problem: Problem, relevant: frozenset[int]) -> Capacities:
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
    scale = COST_UNITS / total if total > 0 else 1.0
    return Capacities(recomputable, keep_plan, keep_bound, exact, scale)


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



class FlowGraph:
    """A flow network on integer nodes with paired residual edges (``e ^ 1`` is ``e``'s reverse).

    Dinic's algorithm, iterative (graphs can be deep); about 5x faster than networkx's
    Boykov-Kolmogorov on these graphs, which matters when a sweep runs hundreds of cuts.
    """

    __slots__ = ("cap", "head", "size", "to")

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
                if pushed == INFINITE:
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


class Network:
    """One group's flow network for one assignment of coupling states; keep capacities set per lambda."""

    def __init__(self, problem: Problem, caps: Capacities, members: tuple[int, ...], touched: tuple[int, ...],
                 pattern: tuple[int, ...], bound: bool, free_recompute: bool = False) -> None:
        values = problem.values
        state = dict(zip(touched, pattern))
        position = {v: k for k, v in enumerate(members)}
        self.source, self.sink = 2 * len(members), 2 * len(members) + 1
        graph = FlowGraph(2 * len(members) + 2)
        self.keep_edges: list[tuple[int, int, float]] = []  # (member position, edge, bytes)
        for k, v in enumerate(members):
            node_in, node_out = 2 * k, 2 * k + 1
            value = values[v]
            nbytes = (caps.keep_bound if bound else caps.keep_plan).get(v)
            edge = graph.add(node_in, node_out, INFINITE if nbytes is None else 0)
            if nbytes is not None:
                self.keep_edges.append((k, edge, nbytes))
            blocked = False
            for u in set(value.inputs):
                if u in position:
                    graph.add(2 * position[u] + 1, node_in, INFINITE)
                elif state.get(u) == BLOCKED:
                    blocked = True  # the input is not in backward: this value cannot be recomputed
            recompute = caps.recomputable[v] and not blocked
            seconds = 0 if free_recompute else int(value.recompute_seconds * caps.scale * DOWN)
            graph.add(self.source, node_in, seconds if recompute else INFINITE)
            if v in problem.backward_reads or state.get(v) == NEEDED:
                graph.add(node_out, self.sink, INFINITE)
        self.graph = graph

    def cut(self, lam: float, scale: float) -> tuple[int, tuple[int, ...]] | None:
        """(cut value in units, member positions kept), or None when no finite cut exists."""
        cap = self.graph.cap
        for _, edge, nbytes in self.keep_edges:
            cap[edge] = int(lam * nbytes * scale * DOWN)
        result = self.graph.min_cut(self.source, self.sink)
        if result is None:
            return None
        value, source_side = result
        kept = tuple(k for k, _, _ in self.keep_edges if source_side[2 * k] and not source_side[2 * k + 1])
        return value, kept


# Storages kept through several values are enumerated (paid or not) up to this many.
MAX_SHARED_STORAGES = 10


def min_bytes_cut(problem: Problem) -> frozenset[int] | None:
    """A keep set with the fewest bytes any valid plan keeps, exact to the byte; None if too many to enumerate.

    With recomputes free and each keep edge carrying its storage's bytes (Python integers, no
    rounding), the minimum cut is the least bytes of any plan when each storage is kept through
    one value. A storage several values could keep (a mutated alias, or a view the network does
    not rebuild from its base) must be paid once however many are kept: each such storage is
    either paid (its values kept for free, its bytes added) or not (none of them kept), and every
    combination is cut; the least total wins. None with more than ``MAX_SHARED_STORAGES``.
    """
    relevant = relevant_values(problem)
    caps = capacities(problem, relevant)
    sizes, values = problem.storage_bytes, problem.values
    holders: dict[int, list[int]] = {}
    for v in caps.keep_plan:
        if sizes[values[v].storage] > 0:
            holders.setdefault(values[v].storage, []).append(v)
    shared = sorted(s for s, vs in holders.items() if len(vs) > 1)
    if len(shared) > MAX_SHARED_STORAGES:
        return None
    members = tuple(sorted(relevant))
    network = Network(problem, caps, members, (), (), bound=False, free_recompute=True)
    best: tuple[int, frozenset[int]] | None = None
    for paid in itertools.product((False, True), repeat=len(shared)):
        charged = {s for s, p in zip(shared, paid) if p}
        cap = network.graph.cap
        for k, edge, nbytes in network.keep_edges:
            storage = values[members[k]].storage
            cap[edge] = nbytes if storage not in shared else (0 if storage in charged else INFINITE)
        result = network.graph.min_cut(network.source, network.sink)
        if result is None:
            continue
        value, source_side = result
        total = value + sum(sizes[s] for s in charged)
        if best is None or total < best[0]:
            keep = frozenset(members[k] for k, _, _ in network.keep_edges
                             if source_side[2 * k] and not source_side[2 * k + 1])
            best = (total, keep)
    return None if best is None else best[1]
