"""Torch-free planners: given a Problem and a byte budget, decide what to keep and what to recompute.

Every planner has one signature, ``fn(problem, budget_bytes=None, **options) -> Plan``, and is
chosen by name from ``SOLVERS`` (``solvers.registry``, which also holds each one's ``SOLVER_INFO``):

* ``"ilp"``: exact (an integer program; see ``solvers.ilp``), honours the budget or raises;
* ``"ilp_peak"``: the budget bounds the simulated peak of the step (``solvers.peak.planner``);
* ``"ilp_offload"``: keep, recompute or offload to host memory (``solvers.offload_planner``;
  the link model in ``solvers.analysis.transfers``); peak budgets: ``"ilp_peak"`` with
  ``cap_solver="ilp_offload"``;
* ``"fast"``: Lagrangian min-cuts shared across identical blocks, then a short ILP; for deep
  models, with an honest gap (``solvers.fast``);
* ``"keep_all"``, ``"recompute_all"``, ``"chen_sqrt"``, ``"per_block"``, ``"selective"``:
  the usual checkpointing heuristics; they record the budget but do not aim for it.

A plan's ``status`` (``Status``) says what is proven: "optimal" only when a check the planner
believes closes the gap (``solvers.mip.run_keep``: every backend answer is verified, and only
well-scaled models certify), "feasible" with the gap to a proven bound otherwise, "time_limit"
when the time limit cut the search short.

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

import inspect

from .analysis import lifetimes, transfers  # noqa: F401  (they register Plan's accounts: problem.ANALYSES)
from .baselines import BASELINES
from .errors import (
    BudgetInfeasibleError,
    RematError,
    SolverError,
    SolverOptionError,
    SolverUnavailableError,
)
from .fast import solve_fast
from .ilp import min_feasible_bytes, solve_ilp
from .analysis.memory import PlanMemory, simulate_plan
from .offload_planner import offload_solver, solve_offload
from .peak import solve_peak
from .problem import Plan, Problem, Value, closure_from_keep_set, format_bytes
from .registry import (
    SOLVER_INFO,
    SOLVERS,
    SolverFn,
    SolverInfo,
    get_solver,
    solver_help,
)
from .status import DEFAULT_TIME_LIMIT, BudgetKind, Status


def solve(problem: Problem, budget_bytes: int | None = None, solver: str = "ilp", **options: object) -> Plan:
    """Plan with the named solver; ``options`` go to it (e.g. ``time_limit=10`` for the ILP).

    Raises SolverOptionError for an option the solver does not take (before it runs).
    """
    planner = get_solver(solver)
    _check_options(solver, planner, options)
    return planner(problem, budget_bytes, **options)


def _check_options(name: str, planner: SolverFn, options: dict[str, object]) -> None:
    parameters = inspect.signature(planner).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    taken = [p for p, spec in parameters.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise SolverOptionError(
            f"the {name!r} planner, chosen for this budget, has no option {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(taken) or 'none'}. Pass the option only with a planner that takes it"
            f"{_owners(unknown)}.")


def _owners(options: list[str]) -> str:
    """Which registered planners take ``options`` (read from their signatures), for the error."""
    found = []
    for option in options:
        owners = [n for n, fn in SOLVERS.items() if option in inspect.signature(fn).parameters]
        described = [f"{n!r}" + (f", the planner of budget_kind='{SOLVER_INFO[n].bounds.value}'"
                                 if SOLVER_INFO[n].bounds is BudgetKind.PEAK else "") for n in owners]
        if described:
            found.append(f"{option!r} belongs to {' and '.join(described)}")
    return f" ({'; '.join(found)})" if found else ""


__all__ = [
    "BASELINES",
    "DEFAULT_TIME_LIMIT",
    "SOLVERS",
    "SOLVER_INFO",
    "BudgetInfeasibleError",
    "BudgetKind",
    "Plan",
    "PlanMemory",
    "Problem",
    "RematError",
    "SolverError",
    "SolverFn",
    "SolverOptionError",
    "SolverInfo",
    "SolverUnavailableError",
    "Status",
    "Value",
    "closure_from_keep_set",
    "format_bytes",
    "get_solver",
    "min_feasible_bytes",
    "offload_solver",
    "simulate_plan",
    "solve",
    "solve_fast",
    "solve_ilp",
    "solve_offload",
    "solve_peak",
    "solver_help",
]
