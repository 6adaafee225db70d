"""Maximum flow / minimum cut on small integer networks (Dinic's algorithm, iterative)."""

from __future__ import annotations

import math
from collections import deque

INFINITE = math.inf


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

