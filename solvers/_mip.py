"""Running a PuLP model on HiGHS or CBC and reading back an honest outcome.

PuLP's own status is not honest enough for a planner that promises a gap: when CBC or HiGHS
stops at its time limit with an incumbent, ``LpStatus[prob.status]`` still reads "Optimal";
only ``prob.sol_status`` says "Solution Found". Everything here reads ``sol_status`` and
fetches a proven lower bound from the backend when it reports one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import pulp

from .errors import SolverError, SolverUnavailableError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "highs", "cbc")

# Both backends stop when the gap is below these, unless told otherwise: tiny, so that
# "optimal" means optimal.
REL_GAP = 1e-9
ABS_GAP = 1e-9

_INSTALL_HINT = {
    "highs": "install it with `pip install highspy` (or use backend='cbc')",
    "cbc": "PuLP's bundled CBC binary is missing or cannot run; reinstall it with "
    "`pip install --force-reinstall pulp` (or `pip install highspy` and use backend='highs')",
}


@dataclass(frozen=True)
class MipResult:
    """What one backend run established.

    ``status`` is "optimal" (proven), "feasible" (incumbent, not proven), "infeasible" or
    "no_solution" (stopped before finding any). ``bound`` is a proven lower bound on the
    minimized objective, None when the backend did not report one.
    """

    status: str
    values: Mapping[str, float] = field(default_factory=dict)
    objective: float | None = None
    bound: float | None = None
    seconds: float = 0.0
    backend: str = ""


@functools.lru_cache(maxsize=None)
def _backend_works(name: str) -> bool:
    """Solve a one-variable MIP: ``available()`` alone misses a broken library or binary."""
    solver = _make_solver(name, time_limit=10.0, threads=None, warm=False, log_path=None)
    if not solver.available():
        return False
    model = pulp.LpProblem("probe", pulp.LpMinimize)
    x = binary(model, "x")
    model += x
    model += x >= 1
    try:
        with _native_stdout_silenced(name == "highs"):
            model.solve(solver)
    except Exception as error:  # any failure means the backend cannot be used
        logger.debug("backend %s failed its probe: %s", name, error)
        return False
    return model.sol_status == pulp.LpSolutionOptimal and abs((x.varValue or 0) - 1) < 1e-6


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


class _WarmHiGHS(pulp.HiGHS):
    """PuLP's HiGHS adapter plus a MIP start (PuLP passes none to HiGHS)."""

    def __init__(self, *args: object, warm: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.warm = warm

    def callSolver(self, lp: pulp.LpProblem) -> None:
        if self.warm:
            _set_start(lp)
        super().callSolver(lp)


def _set_start(lp: pulp.LpProblem) -> None:
    """Hand the variables' initial values to HiGHS (``buildSolverModel`` numbered the columns)."""
    columns = sorted((var.index, var.varValue) for var in lp.variables() if var.varValue is not None)
    if not columns:
        return
    try:
        import numpy  # highspy depends on numpy

        index = numpy.array([c[0] for c in columns], dtype=numpy.int32)
        value = numpy.array([c[1] for c in columns], dtype=numpy.float64)
        lp.solverModel.setSolution(len(columns), index, value)
    except TypeError:  # highspy before the sparse overload: a full column vector
        import highspy

        full = [0.0] * lp.solverModel.getNumCol()
        for position, value in columns:
            full[position] = value
        solution = highspy.HighsSolution()
        solution.col_value = full
        lp.solverModel.setSolution(solution)


def _make_solver(name: str, *, time_limit: float, threads: int | None, warm: bool, log_path: str | None,
                 mip: bool = True, gaps: tuple[float, float] = (REL_GAP, ABS_GAP)) -> pulp.LpSolver:
    rel_gap, abs_gap = gaps
    if name == "highs":
        return _WarmHiGHS(mip=mip, msg=False, timeLimit=time_limit, gapRel=rel_gap, gapAbs=abs_gap,
                          threads=threads, warm=warm)
    with warnings.catch_warnings():
        # PuLP 3.3 deprecates its bundled CBC for 4.0; it is still the dependency-free fallback.
        warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
        return pulp.PULP_CBC_CMD(mip=mip, msg=False, timeLimit=time_limit, gapRel=rel_gap, gapAbs=abs_gap,
                                 threads=threads, warmStart=warm, logPath=log_path)


def binary(model: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A 0/1 variable owned by ``model`` (PuLP 4 style where available, without its warning)."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, 0, 1, cat=pulp.LpBinary)
    return pulp.LpVariable(name, cat=pulp.LpBinary)


def fraction(model: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A continuous variable in [0, 1] owned by ``model``, like ``binary``."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, 0, 1, cat=pulp.LpContinuous)
    return pulp.LpVariable(name, lowBound=0, upBound=1)


@contextlib.contextmanager
def _native_stdout_silenced(active: bool) -> Iterator[None]:
    """Send C-level stdout to /dev/null meanwhile: HiGHS prints a banner there once per process
    whatever its options say, which would corrupt a program's own output (JSON, tables)."""
    if not active:
        yield
        return
    try:
        sys.stdout.flush()
        stdout_fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else 1
        saved = os.dup(stdout_fd)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), stdout_fd)
            yield
    finally:
        os.dup2(saved, stdout_fd)
        os.close(saved)


def _solve_once(model: pulp.LpProblem, backend: str, time_limit: float, threads: int | None, warm: bool, mip: bool,
                gaps: tuple[float, float]) -> tuple[float, float | None]:
    """One backend run; returns its seconds and, for CBC, the bound from its log."""
    with tempfile.TemporaryDirectory(prefix="remat-cbc-") as scratch:
        log_path = os.path.join(scratch, "cbc.log") if backend == "cbc" else None
        solver = _make_solver(backend, time_limit=max(time_limit, 1e-3), threads=threads, warm=warm,
                              log_path=log_path, mip=mip, gaps=gaps)
        began = time.perf_counter()
        with _native_stdout_silenced(backend == "highs"):
            model.solve(solver)
        seconds = time.perf_counter() - began
        return seconds, (_cbc_lower_bound(log_path) if log_path else None)


_SOL_STATUS = {
    pulp.LpSolutionOptimal: "optimal",
    pulp.LpSolutionIntegerFeasible: "feasible",
    pulp.LpSolutionInfeasible: "infeasible",
    pulp.LpSolutionNoSolutionFound: "no_solution",
}


def run_mip(
    model: pulp.LpProblem,
    *,
    backend: str,
    time_limit: float,
    threads: int | None = None,
    start: Mapping[str, float] | None = None,
    mip: bool = True,
    gaps: tuple[float, float] = (REL_GAP, ABS_GAP),
) -> MipResult:
    """Solve ``model`` (a minimization) and report what is proven about it.

    ``start`` maps variable names to a feasible assignment used as a MIP start. ``mip=False``
    solves the LP relaxation, whose optimum is a lower bound of the MIP. ``gaps`` (relative,
    absolute) say when the backend may stop and call its incumbent optimal.
    """
    variables = model.variables()
    if start:
        for var in variables:
            var.setInitialValue(start.get(var.name, 0.0))
    warm = bool(start) and mip
    try:
        seconds, cbc_bound = _solve_once(model, backend, time_limit, threads, warm, mip, gaps)
    except pulp.PulpSolverError as error:
        if not warm:
            raise SolverError(f"the {backend} backend failed on a {len(variables)}-variable model: {error}") from error
        # CBC 2.10 (PuLP's bundled binary) can crash when its time limit expires while it is
        # still processing a MIP start; the start is only a speed-up, so go without it.
        logger.warning("the %s backend crashed with a MIP start (%s); solving again without one", backend, error)
        try:
            seconds, cbc_bound = _solve_once(model, backend, time_limit, threads, False, mip, gaps)
        except pulp.PulpSolverError as again:
            raise SolverError(f"the {backend} backend failed on a {len(variables)}-variable model: {again}") from again
    if warm and _stale_highs_solution(model, backend):
        # HiGHS (1.16) hands back the MIP start as its solution when presolve alone solves the
        # model, while its objective says otherwise; solve again without the start. If that run
        # finds nothing, the start itself is what is known: feasible, nothing proven.
        logger.debug("HiGHS returned the MIP start unchanged; solving again without it")
        seconds, cbc_bound = _solve_once(model, backend, time_limit, threads, False, mip, gaps)
        if _SOL_STATUS.get(model.sol_status) not in ("optimal", "feasible"):
            assert start is not None
            values = {var.name: float(start.get(var.name, 0.0)) for var in variables}
            return MipResult(status="feasible", values=values, objective=_objective_at(model, values),
                             seconds=seconds, backend=backend)
    status = _SOL_STATUS.get(model.sol_status)
    if status is None:
        raise SolverError(f"the {backend} backend returned {pulp.LpSolution.get(model.sol_status)!r}")
    values: dict[str, float] = {}
    objective = None
    bound = None
    if status in ("optimal", "feasible"):
        values = {var.name: float(var.varValue or 0.0) for var in variables}
        objective = float(pulp.value(model.objective) or 0.0)
        bound = objective if status == "optimal" else _reported_bound(model, backend, cbc_bound)
    logger.debug("%s %s on %d variables, %d rows: %s in %.3fs (objective %s, bound %s)", backend,
                 "MIP" if mip else "LP", len(variables), model.numConstraints(), status, seconds, objective, bound)
    return MipResult(status=status, values=values, objective=objective, bound=bound, seconds=seconds, backend=backend)


def _objective_at(model: pulp.LpProblem, values: Mapping[str, float]) -> float:
    """The objective of ``model`` at the given variable values."""
    return float(model.objective.constant) + sum(coef * values.get(var.name, 0.0)
                                                 for var, coef in model.objective.items())


def _stale_highs_solution(model: pulp.LpProblem, backend: str) -> bool:
    """Whether HiGHS's reported objective disagrees with the solution PuLP read back."""
    if backend != "highs" or model.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return False
    try:
        reported = float(model.solverModel.getInfo().objective_function_value)
        columns = float(pulp.value(model.objective) or 0.0)
    except (AttributeError, TypeError, ValueError):
        return False
    return abs(reported - columns) > 1e-6 * max(1.0, abs(reported))


def _reported_bound(model: pulp.LpProblem, backend: str, cbc_bound: float | None) -> float | None:
    """The dual bound the backend proved when it stopped early; None when it gives none."""
    if backend == "cbc":
        return cbc_bound
    try:
        bound = float(model.solverModel.getInfo().mip_dual_bound)
    except (AttributeError, TypeError, ValueError):
        return None
    return bound if abs(bound) < float("inf") else None


_CBC_BOUND = re.compile(r"^Lower bound:\s+(\S+)", re.MULTILINE)


def _cbc_lower_bound(log_path: str) -> float | None:
    """CBC prints its proven bound only to the log: 'Lower bound:  <number>'."""
    try:
        with open(log_path) as log:
            match = _CBC_BOUND.search(log.read())
    except OSError:
        return None
    if not match:
        return None
    try:
        return float(match.group(1))
    except ValueError:
        return None
