"""One backend run of the keep/recompute model for a problem and a budget, and what it proves.

Every planner that solves the integer program goes through ``solve_once``: it builds the model
(``mip.keep_model``), hands the backend a start only when the start satisfies the model's rounded budget
row, runs it (``mip.solve.run_mip``, which checks the backend's answer and owns its quirks) and turns
the solution into a valid ``Plan``, checked against the real budget in exact integers.

What the run proves is decided here, once: a bound or an optimality proof is believed only from
a well-scaled model (``Rounding.well_scaled``). A model with byte-sized coefficients still runs,
in a process that can be stopped, and may find plans, but certifies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .solve import ABS_GAP, REL_GAP, MipResult, run_mip
from .keep_model import Model, Rounding, Weights, build, cap_time, fits, plan_from, start_values
from ..problem import Plan, Problem


class ModelExtension(Protocol):
    """More variables and rows on the keep/recompute model, and how to read a plan back from them
    (``offload_planner``: the host as a third place for a saved storage)."""

    def add(self, model: Model) -> None: ...

    def plan_from(self, problem: Problem, model: Model, result: MipResult, **fields: object) -> Plan: ...


@dataclass(frozen=True)
class Outcome:
    """What one run established.

    ``plan``: its solution as a valid plan, None when none came back. ``fits``: that plan keeps
    at most the real budget (a rounded model can miss it). ``bound``: a lower bound on the
    model's optimum that is believed (None otherwise). ``certified``: the backend proved ``plan``
    optimal for the model, and the model is one whose proofs are believed.
    """

    result: MipResult
    plan: Plan | None = None
    fits: bool = False
    bound: float | None = None
    certified: bool = False

    @property
    def status(self) -> str:
        return self.result.status

    @property
    def stopped(self) -> bool:
        return self.result.stopped


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
    time_cap: float | None = None,
    isolate: bool = False,
) -> Outcome:
    """Solve the model of ``problem`` under ``budget_bytes`` (rounded by ``rounding``) once.

    ``weights`` None with no budget is the min-bytes model. ``start`` is used only when it fits
    the rounded budget row (a start the model rejects would only confuse the backend).
    ``mip=False`` solves the LP relaxation (its objective bounds the MIP). ``extension`` adds to
    the model and reads the plan back. ``time_cap`` (with ``weights``) solves the tie-break
    instead: fewest bytes, then recomputes, among plans whose time is at most ``time_cap`` units
    (``mip.keep_model.cap_time``). ``isolate`` runs the backend in a child stopped at the time limit
    (``mip.backend_run``), as every model that is not well scaled is: for large models on which HiGHS
    has overrun its limit although well scaled (the peak rows of a 12-layer GPT-2: minutes past 20 s).
    """
    model = build(problem, rounding, budget_bytes, None if time_cap is not None else weights)
    if time_cap is not None:
        assert weights is not None
        cap_time(model, rounding, weights, time_cap)
        weights = None  # the objective is no longer the time
    if extension is not None:
        extension.add(model)
    warm = start is not None and mip and (budget_bytes is None or fits(rounding, start, budget_bytes))
    # CBC certified a wrong optimum on the split model (once in 874 realistic budgets; HiGHS never
    # did): there, CBC's runs may find plans but not prove them.
    trusted = rounding.well_scaled and not (rounding.split and backend == "cbc")
    result = run_mip(model.lp, backend=backend, time_limit=max(time_limit, 0.05), threads=threads,
                     start=start_values(model, start) if warm else None, mip=mip, gaps=gaps,
                     isolate=isolate or not trusted)
    bound = result.bound if trusted else None
    if not mip:
        return Outcome(result, bound=result.objective if trusted and result.status == "optimal" else None)
    if result.status not in ("optimal", "feasible"):
        return Outcome(result, bound=None)
    read = extension.plan_from if extension is not None else plan_from
    plan = read(problem, model, result, solver="ilp", budget_bytes=budget_bytes)
    in_budget = budget_bytes is None or plan.kept_bytes <= budget_bytes
    # The plan read back may differ from the columns (the closure drops needless recomputes);
    # it certifies only if it is no worse than the optimum the backend claimed for the model
    # (an extension's own terms are its to check).
    matches = weights is None or extension is not None or result.objective is None or (
        weights.evaluate(plan) <= result.objective * (1 + 1e-9) + 1e-9)
    certified = trusted and result.status == "optimal" and in_budget and matches and (
        budget_bytes is None or fits(rounding, plan, budget_bytes))
    return Outcome(result, plan, in_budget, bound, certified)
