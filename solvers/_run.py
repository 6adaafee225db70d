"""One backend run of the keep/recompute model for a problem and a budget, read back as a plan.

Every planner that solves the integer program goes through ``solve_once``: it builds the model
(``_model``), hands the backend a start only when the start satisfies the model's rounded budget
row, runs it (``_mip.run_mip``, which owns the backends' quirks) and turns the solution into a
valid ``Plan``, saying whether that plan fits the real budget in exact integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ._mip import ABS_GAP, REL_GAP, MipResult, run_mip
from ._model import Model, Rounding, Weights, build, fits, plan_from, start_values
from .problem import Plan, Problem


class ModelExtension(Protocol):
    """More variables and rows on the keep/recompute model, and how to read a plan back from them
    (``offload_planner``: the host as a third place for a saved storage)."""

    def add(self, model: Model) -> None: ...

    def plan_from(self, problem: Problem, model: Model, result: MipResult, **fields: object) -> Plan: ...


@dataclass(frozen=True)
class Outcome:
    """What one run established: the backend's result, and its solution as a plan.

    ``plan`` is None when no solution came back; ``fits`` says whether it keeps at most the
    real budget (a model with rounded or large byte coefficients can miss it by a few bytes).
    """

    result: MipResult
    plan: Plan | None = None
    fits: bool = False

    @property
    def status(self) -> str:
        return self.result.status

    @property
    def bound(self) -> float | None:
        return self.result.bound


def solve_once(
    problem: Problem,
    budget_bytes: int | None,
    *,
    rounding: Rounding,
    weights: Weights | None,
    time_limit: float,
    backend: str,
    start: Plan | None = None,
    threads: int | None = None,
    mip: bool = True,
    gaps: tuple[float, float] = (REL_GAP, ABS_GAP),
    extension: ModelExtension | None = None,
) -> Outcome:
    """Solve the model of ``problem`` under ``budget_bytes`` (rounded by ``rounding``) once.

    ``weights`` None with no budget is the min-bytes model. ``start`` is used only when it fits
    the rounded budget row (a start the model rejects would only confuse the backend).
    ``mip=False`` solves the LP relaxation (its objective bounds the MIP). ``extension`` adds to
    the model and reads the plan back.
    """
    model = build(problem, rounding, budget_bytes, weights)
    if extension is not None:
        extension.add(model)
    warm = start is not None and mip and (budget_bytes is None or fits(rounding, start, budget_bytes))
    result = run_mip(model.lp, backend=backend, time_limit=max(time_limit, 0.05), threads=threads,
                     start=start_values(model, start) if warm else None, mip=mip, gaps=gaps)
    if not mip or result.status not in ("optimal", "feasible"):
        return Outcome(result)
    read = extension.plan_from if extension is not None else plan_from
    plan = read(problem, model, result, solver="ilp", budget_bytes=budget_bytes)
    return Outcome(result, plan, budget_bytes is None or plan.kept_bytes <= budget_bytes)
