"""CP-SAT (OR-Tools) as a backend for PuLP models whose variables are all integral.

The peak planner's exact rows (``solvers.peak.exact_rows``) make a 0/1 model whose LP relaxation is
weak: on the h64 GPT-style model's first exact round HiGHS's bound was still 19% under the
optimum after 40 s, where CP-SAT (clause learning, many strategies in parallel) proves it in
0.2 s (``python -m benchmarks.cpsat_workers``). CP-SAT takes integer variables and integer coefficients only, so a PuLP
model is translated here, with everything that could make its answer wrong handled explicitly:

* a continuous variable is taken as an integer only when the model's builder declared it
  *implied integral* (``mip.solve.fraction``, ``mip.solve.implied_integral``: a max of 0/1 literals, or
  forced both ways by them); any other continuous variable is refused (``SolverError``);
* rows must have integer coefficients (byte units do): a row that does not is refused rather
  than rounded;
* the objective (recompute seconds, floats) is scaled by a power of two and rounded *down*
  term by term, so the bound CP-SAT proves on it, scaled back, is a lower bound on the true
  objective; "optimal" is claimed only when the scaling was exact, else the run is "feasible"
  with that bound (the planners call a plan optimal when its gap to the bound is negligible).

The solution's objective is recomputed from the model's own coefficients (``mip.solve.run_mip``
checks it like any backend's). OR-Tools is a dependency of remat_pass (``pip install ortools``).
"""

from __future__ import annotations

import math
import time

import pulp

from .backend_run import Attempt, model_rows
from ..errors import SolverError

# The largest objective coefficient is scaled to about this many units (the rounding error of
# each term is under one unit, so about 1e-12 of it).
OBJECTIVE_UNITS = 2.0 ** 40
# CP-SAT's workers are strategies more than threads: its LP-based ones start only with 8 or
# more. On the Llama-style model's first exact round (3613 columns, 7886 rows, 2 cores, 20 s;
# ``python -m benchmarks.cpsat_workers``) 2, 4, 6 and 8 workers left the bound 57%, 36%, 11%
# and 2% under the optimum; 12 reached it.
WORKERS = 12
# Integer variables without an upper bound get this one (a byte-unit count never reaches it).
UNBOUNDED = 2 ** 50
# Where a model keeps the names of its implied-integral continuous variables.
_MARK = "_remat_implied_integral"


def available() -> bool:
    """Whether OR-Tools' CP-SAT can be imported."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def implied_integral(model: pulp.LpProblem, var: pulp.LpVariable) -> pulp.LpVariable:
    """Declare ``var`` (continuous, for the LP's sake) integral in every solution that matters:
    whenever the model's integer variables are integral, some optimal value of ``var`` is too
    (a max of 0/1 literals, a sum of integer units, a value forced both ways). CP-SAT then
    takes it as an integer without changing the model's optimum."""
    names = getattr(model, _MARK, None)
    if names is None:
        names = set()
        setattr(model, _MARK, names)
    names.add(var.name)
    return var


def attempt_cpsat(model: pulp.LpProblem, *, time_limit: float, threads: int | None, warm: bool,
                  gaps: tuple[float, float]) -> Attempt:
    """Solve ``model`` (a minimization) once with CP-SAT; ``warm`` hints the variables' initial values.
    ``time_limit`` counts the translation too (seconds for the any-schedule bound's 110k rows)."""
    from ortools.sat.python import cp_model

    translating = time.perf_counter()
    cp = cp_model.CpModel()
    variables = model.variables()
    implied = frozenset(getattr(model, _MARK, ()))
    columns = {var.name: _column(cp, var, implied) for var in variables}
    for row in model_rows(model):
        _add_row(cp, columns, row.name, row)
    scale, exact = _objective(cp, columns, model.objective)
    if warm:
        for var in variables:
            if var.varValue is not None:
                cp.add_hint(columns[var.name], int(round(var.varValue)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit - (time.perf_counter() - translating), 1e-3)
    solver.parameters.num_workers = max(threads or 0, WORKERS)
    solver.parameters.relative_gap_limit = gaps[0]
    solver.parameters.absolute_gap_limit = max(gaps[1] * scale, 0.0)
    began = time.perf_counter()
    code = solver.solve(cp)
    seconds = time.perf_counter() - began
    constant = float(model.objective.constant) if model.objective is not None else 0.0
    if code == cp_model.INFEASIBLE:
        return Attempt(status="infeasible", seconds=seconds, raw_status="INFEASIBLE")
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        status = "no_solution" if code == cp_model.UNKNOWN else None
        return Attempt(status=status, seconds=seconds, raw_status=solver.status_name(code))
    values = {name: float(solver.value(column)) for name, column in columns.items()}
    bound = solver.best_objective_bound / scale + constant
    status = "optimal" if code == cp_model.OPTIMAL and exact else "feasible"
    return Attempt(status=status, values=values, bound=bound, seconds=seconds, raw_status=solver.status_name(code))


def _column(cp: object, var: pulp.LpVariable, implied_integral: frozenset[str]) -> object:
    if var.cat != pulp.LpInteger and var.name not in implied_integral:
        raise SolverError(f"CP-SAT takes integer variables only, and {var.name!r} is continuous: "
                          "use backend='highs' for this model")
    low = math.ceil(var.lowBound) if var.lowBound is not None else -UNBOUNDED
    high = math.floor(var.upBound) if var.upBound is not None else UNBOUNDED
    return cp.new_int_var(low, high, var.name)


def _whole(number: float, what: str) -> int:
    if number != math.floor(number) or not math.isfinite(number):
        raise SolverError(f"CP-SAT takes integer coefficients only; {what} has {number!r}")
    return int(number)


def _add_row(cp: object, columns: dict[str, object], name: str, row: pulp.LpConstraint) -> None:
    """``sum a_i x_i + constant (<=, >=, ==) 0`` with integer ``a_i`` and constant."""
    terms = sum(_whole(coefficient, f"row {name!r}") * columns[var.name] for var, coefficient in row.items())
    rhs = -_whole(row.constant, f"row {name!r}")
    if row.sense == pulp.LpConstraintLE:
        cp.add(terms <= rhs)
    elif row.sense == pulp.LpConstraintGE:
        cp.add(terms >= rhs)
    else:
        cp.add(terms == rhs)


def _objective(cp: object, columns: dict[str, object], objective: pulp.LpAffineExpression | None) -> tuple[float, bool]:
    """Minimize the objective scaled by a power of two, each term rounded down; returns the
    scale and whether the scaling was exact (then CP-SAT's optimum is the model's)."""
    items = list(objective.items()) if objective is not None else []
    for var, _ in items:  # rounding a term down bounds it from below only where its column is >= 0
        if var.lowBound is None or var.lowBound < 0:
            raise SolverError(f"CP-SAT's scaled objective needs columns >= 0, and {var.name!r} may be negative")
    largest = max((abs(c) for _, c in items), default=0.0)
    if largest == 0:
        return 1.0, True
    scale = 2.0 ** math.floor(math.log2(OBJECTIVE_UNITS / largest))
    scaled = [(var, coefficient * scale) for var, coefficient in items]
    cp.minimize(sum(math.floor(c) * columns[var.name] for var, c in scaled))
    return scale, all(c == math.floor(c) for _, c in scaled)
