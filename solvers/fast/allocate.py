"""How many of ``count`` identical groups take each of a few configurations, within a byte budget.

A knapsack with multiplicities: choose ``n_i >= 0`` with ``sum n_i == count`` and
``sum n_i * bytes_i <= room``, least ``sum n_i * seconds_i``. It is solved here in plain Python
rather than handed to a MIP backend: with byte-sized coefficients HiGHS's presolve can loop on
it ignoring its time limit, and CBC can call it infeasible (issue 15, R5). A dynamic program over
the groups keeps the Pareto front of (bytes, seconds) of the partial assignments: exact while the
front stays under ``MAX_FRONT`` points, thinned evenly beyond that (this only refines a plan that
already fits, so a near-best answer is still an improvement).
"""

from __future__ import annotations

from dataclasses import dataclass

# Points of the (bytes, seconds) front kept per step of the dynamic program.
MAX_FRONT = 512


@dataclass(frozen=True)
class Config:
    """One way to plan a group: its kept positions, and what that costs inside the group."""

    positions: tuple[int, ...]
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class _State:
    nbytes: int
    seconds: float
    config: int  # index of the configuration this step added (-1 at the start)
    parent: _State | None


def allocate(configs: list[Config], count: int, room: int) -> list[tuple[Config, int]] | None:
    """The cheapest multiset of ``count`` configurations within ``room`` bytes (None: none fits).

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
    front = [_State(0, 0.0, -1, None)]
    for step in range(1, count + 1):
        slack = room - (count - step) * smallest  # what the groups so far may use
        grown = [_State(s.nbytes + c.nbytes, s.seconds + c.seconds, i, s)
                 for s in front for i, c in enumerate(configs) if s.nbytes + c.nbytes <= slack]
        front = _pareto(grown)
    best = min(front, key=lambda s: (s.seconds, s.nbytes))
    counts: dict[int, int] = {}
    state: _State | None = best
    while state is not None and state.config >= 0:
        counts[state.config] = counts.get(state.config, 0) + 1
        state = state.parent
    return [(configs[i], counts[i]) for i in sorted(counts, key=lambda i: -configs[i].nbytes)]


def _pareto(states: list[_State]) -> list[_State]:
    """States no other beats on both bytes and seconds (ties: the first, deterministic), thinned to ``MAX_FRONT``."""
    states.sort(key=lambda s: (s.nbytes, s.seconds, s.config))
    front: list[_State] = []
    for state in states:
        if not front or state.seconds < front[-1].seconds:
            front.append(state)
    if len(front) > MAX_FRONT:
        step = len(front) / MAX_FRONT
        front = [front[int(k * step)] for k in range(MAX_FRONT - 1)] + [front[-1]]
    return front
