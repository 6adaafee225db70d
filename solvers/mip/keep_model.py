"""The keep/recompute integer program as a PuLP model, and the way back to a Plan.

Variables, per non-available value ``v`` that backward could need (a read or an ancestor):

* ``k_v`` keep (only if keepable), ``r_v`` recompute (only if it can be recomputed in effect);
* ``g_s`` per storage ``s`` with bytes: paid once however many of its values are kept.

Rows: each read is kept or recomputed; a recomputed value has each input kept, recomputed or
available; ``g_s >= k_v``; the paid storages fit the budget.

The objective does not depend on how bytes are rounded, so models that differ only in
rounding (conservative, optimistic, exact) have comparable objectives and bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import pulp

from ..analysis.graph_facts import effectively_recomputable, relevant_values
from .solve import MipResult, binary
from ..errors import SolverError
from ..problem import Plan, Problem, closure_from_keep_set

# Keep-all in at most this many byte units: coefficients stay small and well conditioned.
MAX_UNITS = 2**20
# A model with more units than this in all is not believed when it claims a proof (see ``well_scaled``).
WELL_SCALED_UNITS = 2**24
# Each finer rounding tried to close a gap divides the unit by this.
_REFINE_FACTOR = 16
# Recompute costs are scaled so the smallest is one unit, unless the total would exceed this.
_MAX_COST_UNITS = 1e6
# The smallest recompute cost is this many objective units in the time-only model: backends
# compare objective coefficients with absolute tolerances (CBC's presolve merges columns whose
# costs differ by under ~1e-6), so near-tie costs must differ by far more than that.
_COST_RESOLUTION = 1e6
# The whole tie-break terms at their largest: together far below one cost unit.
_BYTES_TIE_BREAK = 1e-2
_RECOMPUTE_TIE_BREAK = 1e-3


@dataclass(frozen=True)
class Rounding:
    """Bytes per model unit, and which way storages and the budget are rounded.

    ``up`` (conservative): storages up, budget down, so fitting the model means fitting the
    real budget. Not ``up`` (optimistic): the other way, so every real plan fits the model and
    its optimum is a lower bound. With ``exact`` the two coincide.

    ``split``: exact bytes with small coefficients. Each size is ``quantum * units + rest``; an
    integer ``t`` counts the paid units, and the budget row ``quantum * t + sum(rest * g) <= budget``
    has coefficients at most ``quantum``: exact to the byte, yet as well scaled as the unit model.
    """

    quantum: int
    storage_bytes: Mapping[int, int]
    up: bool = True
    split: bool = False

    @property
    def exact(self) -> bool:
        return self.split or all(b % self.quantum == 0 for b in self.storage_bytes.values())

    def split_exact(self) -> "Rounding":
        """The exact, well-scaled model at this unit (see ``split``)."""
        return Rounding(quantum=self.quantum, storage_bytes=self.storage_bytes, up=False, split=True)

    @property
    def well_scaled(self) -> bool:
        """Whether the byte coefficients are small enough for the backends' tolerances.

        With at most ``WELL_SCALED_UNITS`` units in all, an integrality or feasibility tolerance
        of 1e-6 moves the budget row by a few units at most and the plan read back is checked in
        integers anyway; with byte-sized coefficients (10^10) it moves it by thousands, and backends have called
        such models infeasible, looped on them or certified the wrong optimum (issue 15).
        Only a well-scaled model's proof is believed.
        """
        return sum(self.units(s) for s in self.storage_bytes) <= WELL_SCALED_UNITS

    def units(self, storage: int) -> int:
        size = self.storage_bytes.get(storage, 0)
        return -(-size // self.quantum) if self.up else size // self.quantum

    def budget_units(self, budget_bytes: int) -> int:
        return budget_bytes // self.quantum if self.up else -(-budget_bytes // self.quantum)

    def optimistic(self) -> "Rounding":
        return Rounding(quantum=self.quantum, storage_bytes=self.storage_bytes, up=False)


def finer_roundings(problem: Problem, rounding: Rounding) -> list[Rounding]:
    """Conservative roundings with ever smaller units, down to the gcd, while still well scaled."""
    sizes = rounding.storage_bytes
    gcd = math.gcd(*sizes.values()) if sizes else 1
    total = sum(sizes.values())
    found = []
    quantum = rounding.quantum
    while quantum > gcd:
        quantum = max(quantum // _REFINE_FACTOR // gcd * gcd, gcd)
        if total // quantum > WELL_SCALED_UNITS:
            break
        found.append(Rounding(quantum=quantum, storage_bytes=sizes))
    return found


def paid_storage_bytes(problem: Problem) -> dict[int, int]:
    """Sizes of the storages a plan could pay for: those of keepable values backward may need."""
    values = problem.values
    storages = {values[v].storage for v in relevant_values(problem) if values[v].keepable}
    return {s: problem.storage_bytes[s] for s in storages if problem.storage_bytes[s] > 0}


def rounding_for(problem: Problem, exact: bool = False) -> Rounding:
    """The gcd of the sizes when that needs few enough units (no loss), else a coarser unit."""
    sizes = paid_storage_bytes(problem)
    quantum = math.gcd(*sizes.values()) if sizes else 1
    total = sum(sizes.values())
    if not exact and total // quantum > MAX_UNITS:
        quantum = -(-total // MAX_UNITS)
    return Rounding(quantum=quantum, storage_bytes=sizes)


@dataclass(frozen=True)
class Weights:
    """Objective coefficients: scaled recompute costs plus the tie-breaks.

    The tie-break prefers fewer kept bytes, then fewer recomputes; it is far below the
    smallest recompute cost, so it only decides between plans of equal cost.
    """

    cost: Mapping[int, float]
    storage: Mapping[int, float]
    unit_seconds: float = 1.0  # seconds per cost unit: how other times (transfers) join the objective

    def evaluate(self, plan: Plan) -> float:
        """The model objective of ``plan``, so gaps compare like with like."""
        storages = {plan.problem.values[i].storage for i in plan.kept}
        return sum(self.cost.get(i, 0.0) for i in plan.recomputed) + sum(self.storage.get(s, 0.0) for s in storages)


def weights_for(problem: Problem) -> Weights:
    recomputable = effectively_recomputable(problem)
    relevant = [v for v in sorted(relevant_values(problem)) if recomputable[v]]
    positive = [problem.values[v].recompute_seconds for v in relevant if problem.values[v].recompute_seconds > 0]
    unit_seconds = max(min(positive), sum(positive) / _MAX_COST_UNITS) if positive else 1.0
    sizes = paid_storage_bytes(problem)
    per_byte = _BYTES_TIE_BREAK / max(sum(sizes.values()), 1)
    # Fewer bytes first: all recomputes together weigh less than the smallest storage (R6).
    smallest = min(sizes.values(), default=1)
    per_recompute = min(_RECOMPUTE_TIE_BREAK, per_byte * smallest / 2) / max(len(relevant), 1)
    scale = _COST_RESOLUTION
    return Weights(
        cost={v: (problem.values[v].recompute_seconds / unit_seconds + per_recompute) * scale for v in relevant},
        storage={s: per_byte * b * scale for s, b in sizes.items()},
        unit_seconds=unit_seconds / scale,
    )


def time_weights(problem: Problem) -> tuple[Weights, float]:
    """Weights that are recompute seconds over one unit (no tie-breaks), and that unit in seconds.

    The objective then converts back to seconds exactly, so a bound on it bounds seconds.
    """
    recomputable = effectively_recomputable(problem)
    costs = {v: problem.values[v].recompute_seconds for v in relevant_values(problem) if recomputable[v]}
    positive = [c for c in costs.values() if c > 0]
    unit = (max(min(positive), sum(positive) / _MAX_COST_UNITS) if positive else 1.0) / _COST_RESOLUTION
    weights = Weights(cost={v: c / unit for v, c in costs.items()},
                      storage={s: 0.0 for s in paid_storage_bytes(problem)}, unit_seconds=unit)
    return weights, unit


@dataclass(frozen=True)
class Model:
    lp: pulp.LpProblem
    keep: Mapping[int, pulp.LpVariable]
    recompute: Mapping[int, pulp.LpVariable]
    paid: Mapping[int, pulp.LpVariable]
    paid_units: pulp.LpVariable | None = None  # ``t`` of a split rounding
    units_of: Mapping[int, int] | None = None  # the units ``t`` counts per paid storage


def build(problem: Problem, rounding: Rounding, budget_bytes: int | None, weights: Weights | None) -> Model:
    """The time model under a budget, or (``weights`` None, no budget) the min-bytes model."""
    lp = pulp.LpProblem("remat", pulp.LpMinimize)
    model = _variables(problem, lp, rounding)
    _add_rows(problem, model)
    if budget_bytes is not None and rounding.split:
        model = _split_budget_row(model, rounding, budget_bytes)
    elif budget_bytes is not None:
        lp += pulp.lpSum(rounding.units(s) * g for s, g in model.paid.items()) <= rounding.budget_units(
            budget_bytes), "budget"
    if weights is None:
        lp += pulp.lpSum(rounding.units(s) * g for s, g in model.paid.items())
    else:
        lp += pulp.lpSum(weights.cost[v] * r for v, r in model.recompute.items()) + pulp.lpSum(
            weights.storage[s] * g for s, g in model.paid.items())
    return model


def _split_budget_row(model: Model, rounding: Rounding, budget_bytes: int) -> Model:
    lp, q = model.lp, rounding.quantum
    most = sum(rounding.units(s) for s in model.paid)
    units = (lp.add_variable("t", 0, most, cat=pulp.LpInteger) if hasattr(lp, "add_variable")
             else pulp.LpVariable("t", lowBound=0, upBound=most, cat=pulp.LpInteger))
    lp += units == pulp.lpSum(rounding.units(s) * g for s, g in model.paid.items()), "units"
    rest = {s: rounding.storage_bytes[s] - q * rounding.units(s) for s in model.paid}
    lp += q * units + pulp.lpSum(rest[s] * g for s, g in model.paid.items()) <= budget_bytes, "budget"
    return Model(lp=lp, keep=model.keep, recompute=model.recompute, paid=model.paid, paid_units=units,
                 units_of={s: rounding.units(s) for s in model.paid})


def _variables(problem: Problem, lp: pulp.LpProblem, rounding: Rounding) -> Model:
    relevant = sorted(relevant_values(problem))
    can_recompute = effectively_recomputable(problem)
    values = problem.values
    keep = {v: binary(lp, f"k{v}") for v in relevant if values[v].keepable}
    recompute = {v: binary(lp, f"r{v}") for v in relevant if can_recompute[v]}
    storages = sorted({values[v].storage for v in keep} & set(rounding.storage_bytes))
    paid = {s: binary(lp, f"g{s}") for s in storages}
    return Model(lp=lp, keep=keep, recompute=recompute, paid=paid)


def cap_time(model: Model, rounding: Rounding, weights: Weights, time_cap: float) -> None:
    """Turn ``model`` into the tie-break among plans no slower than ``time_cap``.

    A row keeps the recompute time (in ``weights``' units) at most ``time_cap``; the objective
    becomes fewer byte units first, then fewer recomputes (their whole count weighs less than
    one unit, so with whole units the order is strict).
    """
    lp = model.lp
    lp += pulp.lpSum(weights.cost[v] * r for v, r in model.recompute.items()) <= time_cap, "time_cap"
    per_recompute = 1.0 / (len(model.recompute) + 1)
    lp.setObjective(pulp.lpSum(rounding.units(s) * g for s, g in model.paid.items())
                    + pulp.lpSum(per_recompute * r for r in model.recompute.values()))


def _add_rows(problem: Problem, model: Model) -> None:
    values = problem.values
    keep, recompute, paid, lp = model.keep, model.recompute, model.paid, model.lp
    for v in sorted(problem.backward_reads):
        if not values[v].available:
            lp += keep[v] + _var(recompute, v) >= 1, f"read_{v}"
    for v, r_v in recompute.items():
        for u in sorted(set(values[v].inputs)):
            if not values[u].available:
                lp += _var(keep, u) + _var(recompute, u) >= r_v, f"input_{u}_of_{v}"
    for v, k_v in keep.items():
        if values[v].storage in paid:
            lp += paid[values[v].storage] >= k_v, f"pay_{v}"


def _var(variables: Mapping[int, pulp.LpVariable], v: int) -> pulp.LpVariable | int:
    """A missing variable is a choice that is not allowed: it stays 0."""
    return variables.get(v, 0)


def start_values(model: Model, plan: Plan) -> dict[str, float]:
    """Variable values of a known plan, as a MIP start."""
    storages = {plan.problem.values[i].storage for i in plan.kept}
    start = {var.name: float(v in plan.kept) for v, var in model.keep.items()}
    start.update({var.name: float(v in plan.recomputed) for v, var in model.recompute.items()})
    start.update({var.name: float(s in storages) for s, var in model.paid.items()})
    if model.paid_units is not None and model.units_of is not None:
        start[model.paid_units.name] = float(sum(model.units_of[s] for s in storages if s in model.units_of))
    return start


def fits(rounding: Rounding, plan: Plan, budget_bytes: int) -> bool:
    """Whether ``plan`` satisfies the model's (rounded) budget row."""
    storages = {plan.problem.values[i].storage for i in plan.kept}
    if rounding.split:
        return sum(rounding.storage_bytes.get(s, 0) for s in storages) <= budget_bytes
    return sum(rounding.units(s) for s in storages) <= rounding.budget_units(budget_bytes)


def plan_from(problem: Problem, model: Model, result: MipResult, **fields: object) -> Plan:
    """Read the keep set and re-derive the rest: drops any recompute the solution did not need."""
    chosen = {v for v, var in model.keep.items() if result.values.get(var.name, 0.0) > 0.5}
    try:
        kept, recomputed = closure_from_keep_set(problem, chosen)
        return Plan(problem=problem, kept=kept, recomputed=recomputed, **fields)
    except ValueError as error:
        raise SolverError(f"the {result.backend} solution is not a valid plan (numerical trouble?): {error}") from error
