"""One registry of planners: what each one is, and the rituals every call of one shares.

A planner registers a *decision function* with ``@planner(...)``: given a problem and a budget
already normalized to an ``int`` (or None), it returns a ``Decision`` — what to keep, what to
recompute, the status and gap it can claim. The registry wraps it into the public signature
``fn(problem, budget_bytes=None, **options) -> Plan`` and does, once for all planners:

* budget normalization (``operator.index``: a float or bool budget is a caller's mistake);
* the keep-all short-circuit for planners that aim at saved bytes (nothing to decide when
  everything fits);
* timing, and stamping solver name, budget, budget kind and seconds on the ``Plan``;
* the over-budget check: a planner that bounds a budget and returns a plan over it has a bug.

Each entry carries metadata (``SolverInfo``) that CLI help and plots read instead of copying
name lists, and ``get_solver`` is the one place an unknown name becomes a ValueError.
"""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .analysis.graph_facts import forced_keeps
from .errors import SolverError
from . import clock
from .problem import Plan, Problem, closure_from_keep_set
from .status import BudgetKind, Status


@dataclass(frozen=True)
class Decision:
    """What a decision function returns: the plan's sets, and what it can claim about them.

    ``source`` names the planner that produced the sets when it is not this one (``ilp_peak``
    picks among several), stamped as ``"name/source"``; ``predicted_peak_bytes`` is set by
    planners that simulate the peak. ``offloaded`` and ``host_budget_bytes``: planners that
    offload (``solvers.offload_planner``).
    """

    kept: frozenset[int]
    recomputed: frozenset[int]
    status: Status
    gap: float | None = None
    source: str | None = None
    predicted_peak_bytes: int | None = None
    offloaded: frozenset[int] = frozenset()
    host_budget_bytes: int | None = None
    refreshed: frozenset[int] = frozenset()

    @classmethod
    def of(cls, plan: Plan, status: Status, gap: float | None, **fields: object) -> Decision:
        fields.setdefault("offloaded", plan.offloaded)
        fields.setdefault("host_budget_bytes", plan.host_budget_bytes)
        fields.setdefault("refreshed", plan.refreshed)
        return cls(kept=plan.kept, recomputed=plan.recomputed, status=Status(status), gap=gap, **fields)


@dataclass(frozen=True)
class SolverInfo:
    """What a CLI help or a plot says about a planner.

    ``exact``: proves optimality (within its time limit); ``bounds``: what its budget bounds,
    None for heuristics that only record the budget (their plans may exceed it).
    """

    name: str
    description: str
    exact: bool
    bounds: BudgetKind | None

    def help_line(self) -> str:
        kind = "exact" if self.exact else "heuristic"
        target = f"bounds {self.bounds.value} bytes" if self.bounds else "ignores the budget"
        return f"{self.name}: {self.description} ({kind}; {target})"


class SolverFn(Protocol):
    """What every planner in ``SOLVERS`` is."""

    def __call__(self, problem: Problem, budget_bytes: int | None = None, **options: object) -> Plan: ...


DecideFn = Callable[..., Decision]

SOLVERS: dict[str, SolverFn] = {}
SOLVER_INFO: dict[str, SolverInfo] = {}


def normalize_budget(budget_bytes: int | None) -> int | None:
    """The budget as an exact ``int`` (None: unlimited); TypeError for floats and other non-integers."""
    return None if budget_bytes is None else operator.index(budget_bytes)


def keep_all_decision(problem: Problem) -> Decision:
    """Keep everything backward reads (and what cannot be recomputed): optimal when it fits."""
    kept, recomputed = closure_from_keep_set(problem, set(problem.backward_reads) | forced_keeps(problem))
    return Decision(kept=kept, recomputed=recomputed, status=Status.OPTIMAL, gap=0.0)


def planner(name: str, *, description: str, exact: bool,
            bounds: BudgetKind | None) -> Callable[[DecideFn], SolverFn]:
    """Register ``decide`` under ``name`` and return the public planner wrapping it."""
    info = SolverInfo(name=name, description=description, exact=exact, bounds=bounds)

    def register(decide: DecideFn) -> SolverFn:
        @functools.wraps(decide)
        def plan(problem: Problem, budget_bytes: int | None = None, **options: object) -> Plan:
            began = time.perf_counter()
            budget = normalize_budget(budget_bytes)
            if info.bounds is BudgetKind.SAVED and (budget is None or budget >= problem.keep_all_bytes()):
                decision = keep_all_decision(problem)
            else:
                with clock.counting():  # the time limit counts the work done, not a busy machine's waits
                    decision = decide(problem, budget, **options)
            return _stamp(problem, info, decision, budget, time.perf_counter() - began)

        SOLVERS[name] = plan
        SOLVER_INFO[name] = info
        return plan

    return register


def _stamp(problem: Problem, info: SolverInfo, decision: Decision, budget: int | None, seconds: float) -> Plan:
    solver = info.name if decision.source in (None, info.name) else f"{info.name}/{decision.source}"
    plan = Plan(problem=problem, kept=decision.kept, recomputed=decision.recomputed, solver=solver,
                status=Status(decision.status), gap=decision.gap, solve_seconds=seconds, budget_bytes=budget,
                budget_kind=info.bounds or BudgetKind.SAVED, predicted_peak_bytes=decision.predicted_peak_bytes,
                offloaded=decision.offloaded, host_budget_bytes=decision.host_budget_bytes,
                refreshed=decision.refreshed)
    if budget is not None and info.bounds is not None:
        used = plan.kept_bytes if info.bounds is BudgetKind.SAVED else plan.predicted_peak_bytes
        if used is not None and used > budget:
            raise SolverError(f"{solver} plan uses {used} {info.bounds.value} bytes, over the budget of {budget}; "
                              "this is a bug")
    return plan


def get_solver(name: str) -> SolverFn:
    """The planner registered as ``name``; ValueError naming the choices otherwise."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(sorted(SOLVERS))}") from None


def solver_help() -> str:
    """One line per registered planner, for a CLI's help."""
    return "\n".join(SOLVER_INFO[name].help_line() for name in SOLVERS)


__all__ = ["SOLVERS", "SOLVER_INFO", "Decision", "SolverFn", "SolverInfo", "get_solver", "keep_all_decision",
           "normalize_budget", "planner", "solver_help"]
