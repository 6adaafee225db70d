"""One raw backend run of a PuLP model, in this process or in a child that can be stopped.

HiGHS honours its time limit on well-scaled models; on some models with byte-sized coefficients
its presolve loops and never returns (issue 15, R5). Such models run in a forked child that is
killed when the limit (plus a grace) passes, so a planner's time limit holds whatever the backend
does. The run reports exactly what the backend said; ``mip.solve.run_mip`` decides what to believe.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import pulp

from . import pulp_import  # noqa: F401  (PuLP's import-time errors without their callers' frames)

logger = logging.getLogger(__name__)

# Seconds an isolated run may overrun its time limit before it is killed (start-up, read-back).
GRACE_SECONDS = 1.0

_SOL_STATUS = {
    pulp.LpSolutionOptimal: "optimal",
    pulp.LpSolutionIntegerFeasible: "feasible",
    pulp.LpSolutionInfeasible: "infeasible",
    pulp.LpSolutionNoSolutionFound: "no_solution",
}


def model_rows(model: pulp.LpProblem) -> list[pulp.LpConstraint]:
    """The model's rows, in the order they were added: PuLP 3.3 deprecates the name -> row mapping
    for a call that returns them (PuLP 4's form), and both are in use."""
    return model.constraints() if callable(model.constraints) else list(model.constraints.values())


@dataclass(frozen=True)
class Attempt:
    """What one backend run said, unjudged.

    ``status``: as in ``MipResult``, or None when the backend gave a status PuLP cannot name
    (``raw_status`` then says which). ``reported``: the backend's own objective value (HiGHS),
    to compare with the columns'. ``killed``: the run overran its limit and was stopped.
    """

    status: str | None
    values: Mapping[str, float] = field(default_factory=dict)
    reported: float | None = None
    bound: float | None = None
    seconds: float = 0.0
    killed: bool = False
    raw_status: str = ""


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


def make_solver(name: str, *, time_limit: float, threads: int | None, warm: bool, log_path: str | None,
                mip: bool = True, gaps: tuple[float, float]) -> pulp.LpSolver:
    rel_gap, abs_gap = gaps
    if name == "highs":
        return _WarmHiGHS(mip=mip, msg=False, timeLimit=time_limit, gapRel=rel_gap, gapAbs=abs_gap,
                          threads=threads, warm=warm)
    with warnings.catch_warnings():
        # PuLP 3.3 deprecates its bundled CBC for 4.0; it is still the dependency-free fallback.
        warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
        return pulp.PULP_CBC_CMD(mip=mip, msg=False, timeLimit=time_limit, gapRel=rel_gap, gapAbs=abs_gap,
                                 threads=threads, warmStart=warm, logPath=log_path)


@contextlib.contextmanager
def native_stdout_silenced(active: bool) -> Iterator[None]:
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


def attempt(model: pulp.LpProblem, *, backend: str, time_limit: float, threads: int | None, warm: bool,
            mip: bool, gaps: tuple[float, float], isolate: bool) -> Attempt:
    """Run ``model`` once on a PuLP backend (HiGHS, CBC); ``isolate`` runs it in a child killed
    after ``time_limit + GRACE_SECONDS``. CP-SAT runs go through ``solve.attempt`` instead.

    ``warm`` uses the variables' initial values as a MIP start. Raises ``pulp.PulpSolverError``
    when the backend crashes.
    """
    if not isolate:
        return _attempt_here(model, backend, time_limit, threads, warm, mip, gaps)
    return _attempt_isolated(model, backend, time_limit, threads, warm, mip, gaps)


def _attempt_here(model: pulp.LpProblem, backend: str, time_limit: float, threads: int | None, warm: bool,
                  mip: bool, gaps: tuple[float, float]) -> Attempt:
    with tempfile.TemporaryDirectory(prefix="remat-cbc-") as scratch:
        log_path = os.path.join(scratch, "cbc.log") if backend == "cbc" else None
        solver = make_solver(backend, time_limit=max(time_limit, 1e-3), threads=threads, warm=warm,
                             log_path=log_path, mip=mip, gaps=gaps)
        began = time.perf_counter()
        with native_stdout_silenced(backend == "highs"):
            model.solve(solver)
        seconds = time.perf_counter() - began
        status = _SOL_STATUS.get(model.sol_status)
        raw = pulp.LpSolution.get(model.sol_status, str(model.sol_status))
        if status not in ("optimal", "feasible"):
            return Attempt(status=status, seconds=seconds, raw_status=raw)
        values = {var.name: float(var.varValue) if var.varValue is not None else math.nan
                  for var in model.variables()}
        reported, bound = _highs_info(model, status) if backend == "highs" else (None, _cbc_lower_bound(log_path))
        return Attempt(status=status, values=values, reported=reported, bound=bound, seconds=seconds, raw_status=raw)


def _highs_info(model: pulp.LpProblem, status: str) -> tuple[float | None, float | None]:
    """HiGHS's own objective value and, when stopped early, its dual bound."""
    try:
        info = model.solverModel.getInfo()
        reported = float(info.objective_function_value)
        bound = reported if status == "optimal" else float(info.mip_dual_bound)
    except (AttributeError, TypeError, ValueError):
        return None, None
    return reported, (bound if math.isfinite(bound) else None)


def _attempt_isolated(model: pulp.LpProblem, backend: str, time_limit: float, threads: int | None, warm: bool,
                      mip: bool, gaps: tuple[float, float]) -> Attempt:
    try:
        context = multiprocessing.get_context("fork")
    except ValueError:  # no fork (Windows): run here, and rely on the backend's own limit
        logger.debug("no fork on this platform: running the %s model in this process", backend)
        return _attempt_here(model, backend, time_limit, threads, warm, mip, gaps)
    receiver, sender = context.Pipe(duplex=False)
    began = time.perf_counter()
    child = context.Process(target=_child, args=(model, backend, time_limit, threads, warm, mip, gaps, sender),
                            daemon=True)
    child.start()
    sender.close()
    try:
        if receiver.poll(time_limit + GRACE_SECONDS):
            result = receiver.recv()
        else:
            result = None
    except (EOFError, OSError):
        result = Attempt(status=None, raw_status="the isolated run died")
    finally:
        receiver.close()
        _stop(child)
    if result is None:
        logger.warning("the %s backend overran its %.3gs time limit; stopped it", backend, time_limit)
        return Attempt(status="no_solution", seconds=time.perf_counter() - began, killed=True,
                       raw_status="killed at the time limit")
    if isinstance(result, BaseException):
        raise pulp.PulpSolverError(str(result))
    return result


def _child(model: pulp.LpProblem, backend: str, time_limit: float, threads: int | None, warm: bool, mip: bool,
           gaps: tuple[float, float], sender: object) -> None:
    """In the forked child: its own process group (so CBC dies with it), a fresh HiGHS scheduler."""
    try:
        os.setsid()
        if backend == "highs":
            import highspy

            highspy.Highs.resetGlobalScheduler(True)
        sender.send(_attempt_here(model, backend, time_limit, threads, warm, mip, gaps))
    except BaseException as error:  # reported to the parent, which raises it there
        with contextlib.suppress(Exception):
            sender.send(RuntimeError(f"{type(error).__name__}: {error}"))
    finally:
        os._exit(0)


def _stop(child: multiprocessing.process.BaseProcess) -> None:
    """Kill the child's whole process group (a CBC binary included) and reap it."""
    if child.pid is not None and child.is_alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
    child.join(timeout=5)


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
