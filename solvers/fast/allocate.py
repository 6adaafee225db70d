"""How many of ``count`` identical groups take each of a few configurations, within a byte budget.

A knapsack with multiplicities: choose ``n_i >= 0`` with ``sum n_i == count`` and
``sum n_i * bytes_i <= room``, least ``sum n_i * seconds_i``. It is solved here (numpy arrays)
rather than handed to a MIP backend: with byte-sized coefficients HiGHS's presolve can loop on
it ignoring its time limit, and CBC can call it infeasible (issue 15, R5). A dynamic program over
the groups keeps the Pareto front of (bytes, seconds) of the partial assignments: exact while the
front stays under ``MAX_FRONT`` points, thinned evenly beyond that (this only refines a plan that
already fits, so a near-best answer is still an improvement).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

# Points of the (bytes, seconds) front kept per step of the dynamic program.
MAX_FRONT = 512


@dataclass(frozen=True)
class Config:
    """One way to plan a group: its kept positions, and what that costs inside the group."""

    positions: tuple[int, ...]
    nbytes: int
    seconds: float


def allocate(configs: list[Config], count: int, room: int) -> list[tuple[Config, int]] | None:
    """The cheapest multiset of ``count`` configurations within ``room`` bytes (None: none fits).

    Each step of the dynamic program grows every point of the front by every configuration and
    keeps the new front, in numpy arrays (one step of 126 Llama-3-405B layers took 38 ms as Python
    objects, 4.8 s in all, past the planner's 2 s limit; the answer is the same). Bytes stay
    integers (int64: byte counts of real models reach 10^11, far below its range).

    >>> a, b = Config((0,), 10, 0.0), Config((), 0, 1.0)
    >>> [(c.nbytes, n) for c, n in allocate([a, b], 3, 25)]
    [(10, 2), (0, 1)]
    """
    configs = [c for c in configs if c.nbytes * count <= room or c.nbytes <= room]
    if not configs:
        return None
    smallest = min(c.nbytes for c in configs)
    if smallest * count > room:
        return None
    config_bytes = numpy.array([c.nbytes for c in configs], dtype=numpy.int64)
    config_seconds = numpy.array([c.seconds for c in configs], dtype=numpy.float64)
    front_bytes, front_seconds = numpy.zeros(1, dtype=numpy.int64), numpy.zeros(1, dtype=numpy.float64)
    steps: list[tuple[numpy.ndarray, numpy.ndarray]] = []  # per step: each point's parent and configuration
    for step in range(1, count + 1):
        slack = room - (count - step) * smallest  # what the groups so far may use
        grown_bytes = (front_bytes[:, None] + config_bytes[None, :]).ravel()  # parent-major, as the front is
        grown_seconds = (front_seconds[:, None] + config_seconds[None, :]).ravel()
        fits = numpy.flatnonzero(grown_bytes <= slack)
        kept = fits[_pareto(grown_bytes[fits], grown_seconds[fits], fits % len(configs))]
        steps.append((kept // len(configs), kept % len(configs)))
        front_bytes, front_seconds = grown_bytes[kept], grown_seconds[kept]
    point = int(numpy.lexsort((front_bytes, front_seconds))[0])  # least seconds, then least bytes
    counts: dict[int, int] = {}
    for parents, chosen in reversed(steps):
        counts[int(chosen[point])] = counts.get(int(chosen[point]), 0) + 1
        point = int(parents[point])
    return [(configs[i], counts[i]) for i in sorted(counts, key=lambda i: -configs[i].nbytes)]


def _pareto(nbytes: numpy.ndarray, seconds: numpy.ndarray, config: numpy.ndarray) -> numpy.ndarray:
    """Indices of the points no other beats on both bytes and seconds, in order of bytes (ties: the
    first in (bytes, seconds, configuration) order, then in given order: deterministic), thinned
    evenly to ``MAX_FRONT``."""
    order = numpy.lexsort((config, seconds, nbytes))  # stable: equal keys keep their given order
    ordered = seconds[order]
    before = numpy.concatenate(([numpy.inf], numpy.minimum.accumulate(ordered)[:-1]))
    front = order[ordered < before]  # strictly cheaper than every point with fewer (or as many) bytes
    if len(front) > MAX_FRONT:
        step = len(front) / MAX_FRONT
        front = front[[int(k * step) for k in range(MAX_FRONT - 1)] + [len(front) - 1]]
    return front
