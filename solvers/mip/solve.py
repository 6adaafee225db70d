"""Running a PuLP model on HiGHS or CBC, and deciding which of its answer to believe.

PuLP's own status is not honest enough for a planner that promises a gap: when CBC or HiGHS
stops at its time limit with an incumbent, ``LpStatus[prob.status]`` still reads "Optimal";
only ``prob.sol_status`` says "Solution Found". Backends also return answers that do not hold
up (issue 15): HiGHS hands back the MIP start while reporting a better objective (R1), or
optimal columns that are NaN (R4). ``run_mip`` checks every solution it is given — finite,
integral where it must be, the backend's objective equal to the one its columns give — runs
again without the start when the start may be the culprit, and otherwise keeps only what is
known: the start itself as a feasible solution, nothing proven.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Mapping

import pulp

from . import backend_run, cpsat
from .backend_run import Attempt, make_solver, native_stdout_silenced
from .cpsat import implied_integral
from ..errors import SolverError, SolverUnavailableError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "highs", "cbc", "cpsat")

# Both backends stop when the gap is below these, unless told otherwise: tiny, so that
# "optimal" means optimal.
REL_GAP = 1e-9
ABS_GAP = 1e-9

_INSTALL_HINT = {
    "highs": "install it with `pip install highspy` (or use backend='cbc')",
    "cbc": "PuLP's bundled CBC binary is missing or cannot run; reinstall it with "
    "`pip install --force-reinstall pulp` (or `pip install highspy` and use backend='highs')",
    "cpsat": "install OR-Tools with `pip install ortools` (remat_pass depends on it; this environment lacks it)",
}


@dataclass(frozen=True)
class MipResult:
    """What one backend run established, once checked.

    ``status`` is "optimal" (proven), "feasible" (incumbent, not proven), "infeasible" or
    "no_solution" (stopped before finding any, or none that held up). ``bound`` is a proven
    lower bound on the minimized objective, None when the backend did not report one or its
    answer was not believed. ``stopped``: the run ended at its time limit (or was killed
    there). ``distrusted``: why the backend's own answer was set aside, if it was.
    """

    status: str
    values: Mapping[str, float] = field(default_factory=dict)
    objective: float | None = None
    bound: float | None = None
    seconds: float = 0.0
    backend: str = ""
    stopped: bool = False
    distrusted: str | None = None


def attempt(model: pulp.LpProblem, *, backend: str, time_limit: float, threads: int | None, warm: bool,
            mip: bool, gaps: tuple[float, float], isolate: bool) -> Attempt:
    """Run ``model`` once on ``backend``: CP-SAT (``cpsat``, which builds on ``backend_run``, so the
    choice is made here, above both) or a PuLP backend (``backend_run.attempt``, which says how)."""
    if backend == "cpsat":  # it honours its time limit: no child needed
        if not mip:
            raise ValueError("CP-SAT solves integer programs only, not LP relaxations")
        return cpsat.attempt_cpsat(model, time_limit=time_limit, threads=threads, warm=warm, gaps=gaps)
    return backend_run.attempt(model, backend=backend, time_limit=time_limit, threads=threads, warm=warm, mip=mip,
                               gaps=gaps, isolate=isolate)


@functools.lru_cache(maxsize=None)
def _backend_works(name: str) -> bool:
    """Solve a one-variable MIP: ``available()`` alone misses a broken library or binary."""
    model = pulp.LpProblem("probe", pulp.LpMinimize)
    x = binary(model, "x")
    model += x
    model += x >= 1
    if name == "cpsat":
        if not cpsat.available():
            return False
        try:
            raw = attempt(model, backend=name, time_limit=10.0, threads=1, warm=False, mip=True,
                          gaps=(REL_GAP, ABS_GAP), isolate=False)
        except Exception as error:  # any failure means the backend cannot be used
            logger.debug("backend %s failed its probe: %s", name, error)
            return False
        return raw.status == "optimal" and abs(raw.values.get("x", 0.0) - 1) < 1e-6
    solver = make_solver(name, time_limit=10.0, threads=None, warm=False, log_path=None, gaps=(REL_GAP, ABS_GAP))
    if not solver.available():
        return False
    try:
        with native_stdout_silenced(name == "highs"):
            model.solve(solver)
    except Exception as error:  # any failure means the backend cannot be used
        logger.debug("backend %s failed its probe: %s", name, error)
        return False
    return model.sol_status == pulp.LpSolutionOptimal and abs((x.varValue or 0) - 1) < 1e-6


def backend_works(name: str) -> bool:
    """Whether backend ``name`` is installed and solves a trivial MIP (probed once per process)."""
    return _backend_works(name)


def resolve_backend(name: str) -> str:
    """Map "auto" to HiGHS when it works, else CBC; raise SolverUnavailableError with a fix."""
    if name not in BACKENDS:
        raise ValueError(f"unknown ILP backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        if not _backend_works(name):
            raise SolverUnavailableError(f"ILP backend {name!r} is not usable: {_INSTALL_HINT[name]}")
        return name
    for candidate in ("highs", "cbc"):
        if _backend_works(candidate):
            return candidate
    raise SolverUnavailableError(
        "no ILP backend works: `pip install highspy`, or reinstall PuLP (`pip install --force-reinstall pulp`) "
        "for its bundled CBC"
    )


def binary(model: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A 0/1 variable owned by ``model`` (PuLP 4 style where available, without its warning)."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, 0, 1, cat=pulp.LpBinary)
    return pulp.LpVariable(name, cat=pulp.LpBinary)


def fraction(model: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A continuous variable in [0, 1] owned by ``model``, like ``binary``, that the caller's
    rows make integral once the binaries are (a max of 0/1 literals, or forced both ways by
    them): continuous for the LP relaxation, an integer for CP-SAT (``cpsat.implied_integral``)."""
    if hasattr(model, "add_variable"):
        return implied_integral(model, model.add_variable(name, 0, 1, cat=pulp.LpContinuous))
    return implied_integral(model, pulp.LpVariable(name, lowBound=0, upBound=1))


def add_row(lp: pulp.LpProblem, coefficients: dict[pulp.LpVariable, int], sense: int, rhs: int,
            name: str | None = None) -> None:
    """``sum(c * x) <sense> rhs`` added to ``lp`` as one expression: PuLP's operators copy the
    expression at each ``+`` (most of the rows' build time on deep models). Without ``name``
    the row gets PuLP's next automatic one, as with ``lp += row``."""
    lp.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(coefficients), sense=sense, rhs=rhs), name)


def run_mip(
    model: pulp.LpProblem,
    *,
    backend: str,
    time_limit: float,
    threads: int | None = None,
    start: Mapping[str, float] | None = None,
    mip: bool = True,
    gaps: tuple[float, float] = (REL_GAP, ABS_GAP),
    isolate: bool = False,
) -> MipResult:
    """Solve ``model`` (a minimization) and report what is proven about it.

    ``start`` maps variable names to a feasible assignment used as a MIP start. ``mip=False``
    solves the LP relaxation, whose optimum is a lower bound of the MIP. ``gaps`` (relative,
    absolute) say when the backend may stop and call its incumbent optimal. ``isolate`` runs the
    backend where it can be stopped (for models it may loop on; see ``mip.backend_run``).
    """
    variables = model.variables()
    if start:
        for var in variables:
            var.setInitialValue(start.get(var.name, 0.0))
    warm = bool(start) and mip
    raw = _attempt_or_raise(model, backend, time_limit, threads, warm, mip, gaps, isolate)
    doubt = _doubt(model, raw, mip)
    if doubt and warm:
        # The start may be what confused the backend (HiGHS 1.16 returns it unchanged when
        # presolve alone solves the model): solve again without it.
        logger.debug("%s answer set aside (%s); solving again without the MIP start", backend, doubt)
        raw = _attempt_or_raise(model, backend, time_limit, threads, False, mip, gaps, isolate)
        doubt = _doubt(model, raw, mip)
    if doubt:
        logger.info("%s answer not believed: %s", backend, doubt)
        if start and mip:  # what is known: the start is feasible (callers only pass feasible starts)
            values = {var.name: float(start.get(var.name, 0.0)) for var in variables}
            return MipResult(status="feasible", values=values, objective=_objective_at(model, values),
                             seconds=raw.seconds, backend=backend, stopped=raw.killed, distrusted=doubt)
        return MipResult(status="no_solution", seconds=raw.seconds, backend=backend, stopped=raw.killed,
                         distrusted=doubt)
    return _result(model, raw, backend, mip)


def _attempt_or_raise(model: pulp.LpProblem, backend: str, time_limit: float, threads: int | None, warm: bool,
                      mip: bool, gaps: tuple[float, float], isolate: bool) -> Attempt:
    size = len(model.variables())
    try:
        return attempt(model, backend=backend, time_limit=time_limit, threads=threads, warm=warm, mip=mip, gaps=gaps,
                       isolate=isolate)
    except pulp.PulpSolverError as error:
        if not warm:
            raise SolverError(f"the {backend} backend failed on a {size}-variable model: {error}") from error
        # CBC 2.10 (PuLP's bundled binary) can crash when its time limit expires while it is
        # still processing a MIP start; the start is only a speed-up, so go without it.
        logger.warning("the %s backend crashed with a MIP start (%s); solving again without one", backend, error)
    try:
        return attempt(model, backend=backend, time_limit=time_limit, threads=threads, warm=False, mip=mip, gaps=gaps,
                       isolate=isolate)
    except pulp.PulpSolverError as again:
        raise SolverError(f"the {backend} backend failed on a {size}-variable model: {again}") from again


def _doubt(model: pulp.LpProblem, raw: Attempt, mip: bool) -> str | None:
    """Why the backend's solution cannot be taken at its word; None when it checks out."""
    if raw.status is None:
        return f"status {raw.raw_status!r}"
    if raw.status not in ("optimal", "feasible"):
        return None
    values = raw.values
    if not all(math.isfinite(v) for v in values.values()):
        return "non-finite column values"
    if mip:
        integral = {var.name for var in model.variables() if var.cat == pulp.LpInteger}
        off = max((abs(values[name] - round(values[name])) for name in integral if name in values), default=0.0)
        if off > _INTEGRALITY:
            return f"a column {off:.2g} from integral"
    objective = _objective_at(model, values)
    if raw.reported is not None and abs(raw.reported - objective) > _OBJECTIVE_AGREEMENT * max(1.0, abs(objective)):
        return f"objective {raw.reported!r} reported, {objective!r} from the columns (a stale start?)"
    return None


def _result(model: pulp.LpProblem, raw: Attempt, backend: str, mip: bool) -> MipResult:
    status = raw.status
    assert status is not None
    stopped = raw.killed or (mip and status in ("feasible", "no_solution"))
    if status not in ("optimal", "feasible"):
        result = MipResult(status=status, seconds=raw.seconds, backend=backend, stopped=stopped)
    else:
        objective = _objective_at(model, raw.values)
        bound = raw.bound if status == "feasible" else (raw.reported if raw.reported is not None else objective)
        result = MipResult(status=status, values=dict(raw.values), objective=objective, bound=bound,
                           seconds=raw.seconds, backend=backend, stopped=stopped)
    logger.debug("%s %s on %d variables, %d rows: %s in %.3fs (objective %s, bound %s)", backend,
                 "MIP" if mip else "LP", len(model.variables()), model.numConstraints(), result.status, result.seconds,
                 result.objective, result.bound)
    return result


def _objective_at(model: pulp.LpProblem, values: Mapping[str, float]) -> float:
    """The objective of ``model`` at the given variable values."""
    return float(model.objective.constant) + sum(coef * values.get(var.name, 0.0)
                                                 for var, coef in model.objective.items())


# Integer columns further than this from a whole number are not a solution the backend should return.
_INTEGRALITY = 1e-5
# The backend's objective and the columns' must agree to this relative precision.
_OBJECTIVE_AGREEMENT = 1e-6
