"""Torch-free planners: given a Problem and a byte budget, decide what to keep and what to recompute.

Every planner has one signature, ``fn(problem, budget_bytes=None, **options) -> Plan``, and is
chosen by name from ``SOLVERS``:

* ``"ilp"``: exact (an integer program; see ``solvers.ilp``), honours the budget or raises;
* ``"ilp_peak"``: the budget bounds the simulated peak of the step (``solvers.peak``);
* ``"fast"``: Lagrangian min-cuts shared across identical blocks, then a short ILP; for deep
  models, with an honest gap (``solvers.mincut``);
* ``"keep_all"``, ``"recompute_all"``, ``"chen_sqrt"``, ``"per_block"``, ``"selective"``:
  the usual checkpointing heuristics; they record the budget but do not aim for it.

>>> x = Value(0, "x", (), storage=0, available=True)
>>> h = Value(1, "h", (0,), storage=1, recompute_seconds=1e-3)
>>> y = Value(2, "y", (1,), storage=2, recompute_seconds=2e-3)
>>> problem = Problem((x, h, y), (0, 100, 100), frozenset({1, 2}))
>>> min_feasible_bytes(problem)  # everything can be recomputed from x
0
>>> sorted(solve(problem, budget_bytes=100).recomputed)
[1]
"""

from __future__ import annotations

from typing import Protocol

from .baselines import BASELINES
from .errors import BudgetInfeasibleError, RematError, SolverError, SolverUnavailableError
from .ilp import min_feasible_bytes, solve_ilp
from .memory import PlanMemory, simulate_plan
from .mincut import solve_fast
from .peak import solve_peak
from .problem import Plan, Problem, Value, closure_from_keep_set, format_bytes


class SolverFn(Protocol):
    """What every planner in ``SOLVERS`` is."""

    def __call__(self, problem: Problem, budget_bytes: int | None = None, **options: object) -> Plan: ...


SOLVERS: dict[str, SolverFn] = {"ilp": solve_ilp, "ilp_peak": solve_peak, "fast": solve_fast, **BASELINES}


def solve(problem: Problem, budget_bytes: int | None = None, solver: str = "ilp", **options: object) -> Plan:
    """Plan with the named solver; ``options`` go to it (e.g. ``time_limit=10`` for the ILP)."""
    try:
        planner = SOLVERS[solver]
    except KeyError:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(sorted(SOLVERS))}") from None
    return planner(problem, budget_bytes, **options)


__all__ = [
    "SOLVERS",
    "BudgetInfeasibleError",
    "Plan",
    "Problem",
    "RematError",
    "SolverError",
    "SolverFn",
    "SolverUnavailableError",
    "Value",
    "closure_from_keep_set",
    "format_bytes",
    "min_feasible_bytes",
    "simulate_plan",
    "PlanMemory",
    "solve",
]
