"""A plan cache on disk, so that a restarted job skips the solve.

Planning a graph is capture + annotate (seconds) and a solve (up to the time limit). The solve is
a pure function of the torch-free ``Problem`` and the planning inputs, so its answer can be
stored: ``PlanCache(directory)`` keeps one small JSON file per key, where the key is a SHA-256 of

* the problem, every field of it (each value's op, inputs, storage, bytes, recompute cost, tags,
  module path; what backward reads and in which steps; the device): the graph as planners see it,
  except measured recompute costs (below);
* the planning inputs, every field of ``PlanOptions`` (budget, budget kind, solver, device
  profile, time limit, solver options, offload, what to do when a budget is infeasible);
* the versions of remat_pass and torch (a new release may plan differently), and a digest of
  remat_pass's own source files (an edited checkout plans with its own code, never a stale plan).

Any change of these is a miss and a new solve.

Where it lives: on by default, in ``~/.cache/remat_pass/plans`` (``$XDG_CACHE_HOME/remat_pass/plans``
where that is set: ``default_directory``), for
``optimize``, ``backend``, ``plan``, ``explain`` and the registered "remat" backend alike, so a new
``RematModule``, a recompile, or a second process planning the same graph under the same inputs
reuses the plan. ``plan_cache=`` chooses: a directory or a ``PlanCache`` (that one), ``True`` (the
default directory), ``False`` or ``None`` (no cache: every graph is solved).

Measured costs (``costs="measure"``, ``op_timing``) jitter from run to run, so a key with them
in it would never hit again. A measured problem is keyed by its structure alone (every field but
``Value.recompute_seconds``; the cost model is in the key, as ``Problem.costs`` and in the
planning inputs), and the record keeps the costs the plan was solved with. On a hit the plan is
checked and re-priced against this run's problem:

* it still fits: kept and offloaded bytes depend on bytes only, which are in the key; the
  simulated peak (``predicted_peak_bytes``) is simulated again, since an offloaded storage's
  transfers are timed by op costs, and a peak above the one the plan was made with is a miss;
* its predicted cost is this run's (the ``Plan`` properties read the problem it is built on);
* its ``status`` and ``gap`` claim no more than holds: if every recomputable value's cost is at
  least ``rho`` times its old one, every plan costs at least ``rho`` times what it did, so
  ``rho`` times the old lower bound still bounds the optimum and gives the gap (without offload:
  an offloaded transfer's exposed time is not monotone in op costs, so there the gap is unknown).

``plan()``, ``plan_with_report()`` and ``explain()`` also look a result up *before* tracing, under
a key made from the model, its inputs and the global state a trace reads (``planning.trace_key``,
which says what that key cannot see); those results are pickled under ``traced/`` and read back by
an unpickler that builds remat_pass's records only (``get_traced``, ``put_traced``).

Under Inductor a compile is also cached by Inductor's own caches, keyed by the graph and every
planning input (``compiled_key``; ``capture.cached_compile``); on their hit nothing is traced or
planned, so what the compile's planning produced is stored under ``compiled/`` by that key: its
``Plan`` (with its problem), its refusal (``Refusal``), that it had nothing to plan
(``Unplanned``), where a peak budget's fit ended (``inductor_fit.FitOutcome``), or the new identity
a compile was made again under after its plan was lost (``Renewed``). Pickled and read back like ``traced/``.

Quantizing the measured costs into the key was the alternative; it was not taken because a
graph has hundreds of ops, and one of them jittering across a bucket edge is a miss. Hits and misses are logged at INFO and counted
(``cache.hits``, ``cache.misses``). A file that cannot be read is a miss (and is overwritten);
a file that cannot be written is a warning, never a failed step. The files are small (a
plan's value ids and numbers: a few KB to a few hundred KB) and never cleaned up: delete the
directory to empty it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import math
import os
import pickle
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.errors import BudgetInfeasibleError
from remat_pass.solvers.problem import Plan, Problem
from remat_pass.solvers.status import CLOSED_GAP, Status, relative_gap

logger = logging.getLogger(__name__)

FORMAT = 1

DEFAULT_DIRECTORY: Path | None = None
"""Where plans are cached unless told otherwise (``plan_cache=True``, the front doors' default);
None: ``remat_pass/plans`` in the user's cache directory (``default_directory``)."""


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/remat_pass/plans``, ``~/.cache/remat_pass/plans`` where that is unset
    (the XDG convention for a user's caches), or ``DEFAULT_DIRECTORY`` when set."""
    if DEFAULT_DIRECTORY is not None:
        return Path(DEFAULT_DIRECTORY).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "remat_pass" / "plans"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _canonical(value: Any) -> Any:
    """JSON-ready and independent of hash order: dataclasses by field, sets sorted, floats exact."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return sorted([str(k), _canonical(v)] for k, v in value.items())
    if isinstance(value, float):
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def _measured(problem: Problem) -> bool:
    return problem.costs == "measure"


def problem_digest(problem: Problem) -> str:
    """SHA-256 of every field of the problem (values, storages, reads, steps, device, ...); of a
    measured problem's, all but the measured ``recompute_seconds`` (see the module)."""
    record = _canonical(problem)
    if _measured(problem):
        for value in record["values"]:
            value["recompute_seconds"] = None
    return hashlib.sha256(json.dumps(record, separators=(",", ":")).encode()).hexdigest()


def _planning_inputs(options: Any) -> dict[str, Any]:
    """Every field of ``PlanOptions`` but the cache itself, and the versions that plan."""
    fields = {f.name: _canonical(getattr(options, f.name)) for f in dataclasses.fields(options) if f.name != "plan_cache"}
    return {**fields, **planning_versions()}


def planning_versions() -> dict[str, Any]:
    """What plans besides the planning inputs: remat_pass's and torch's versions, the record
    format and the digest of remat_pass's own source."""
    return {"remat_pass": _version("remat-pass"), "torch": _version("torch"), "format": FORMAT, "code": code_digest()}


canonical = _canonical


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 of remat_pass's and its planners' source files (read once per process, ~100 files)."""
    from remat_pass import solvers

    digest = hashlib.sha256()
    for root in sorted({Path(__file__).parent, Path(solvers.__file__).parent}):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def compiled_key(graph: str, options: Any) -> str:
    """The identity of compiling a graph (``cached_compile.graph_digest``) under ``options``:
    what torch's caches key that compile by, and what its plan is stored under."""
    record = {"graph": graph, "options": _planning_inputs(options)}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def cache_key(problem: Problem, options: Any) -> str:
    """The file name a plan for ``problem`` under ``options`` is stored as."""
    record = {"problem": problem_digest(problem), "options": _planning_inputs(options)}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A budget refused (``BudgetInfeasibleError``), stored so that the same compile is refused
    again without tracing and planning: the Inductor fit's refused candidates, whose refusals
    AOTAutograd's cache does not keep, took 27 s each to plan again in a restarted job."""

    budget_bytes: int
    min_bytes: int
    keep_all_bytes: int
    kind: str
    proven_min_bytes: int | None
    input_bytes: int
    message: str
    lowest_kept_bytes: int | None = None

    @classmethod
    def of(cls, error: BudgetInfeasibleError) -> "Refusal":
        return cls(error.budget_bytes, error.min_bytes, error.keep_all_bytes, error.kind, error.proven_min_bytes,
                   error.input_bytes, str(error.args[0]) if error.args else "", error.lowest_kept_bytes)

    def error(self) -> BudgetInfeasibleError:
        """The refusal raised again, its message as it was."""
        error = BudgetInfeasibleError(self.budget_bytes, self.min_bytes, self.keep_all_bytes, self.kind,
                                      proven_min_bytes=self.proven_min_bytes, input_bytes=self.input_bytes,
                                      lowest_kept_bytes=self.lowest_kept_bytes)
        error.args = (self.message,)
        return error


@dataclasses.dataclass(frozen=True)
class Unplanned:
    """A compile with nothing to plan (no backward graph): its cache hit needs no plan."""


@dataclasses.dataclass(frozen=True)
class Renewed:
    """torch's caches hold a program under a compile's identity whose plan this cache lost (it was
    emptied or moved, Inductor's was not), and a plan made again may differ from that program's (the
    searches are time-limited): the compile was made again under ``identity``, a new one, and later
    compiles of it use that (``capture.cached_compile``)."""

    identity: str


@dataclasses.dataclass
class PlanCache:
    """Plans on disk under ``directory``, one JSON file per (problem, planning inputs) key.

    >>> import tempfile
    >>> cache = PlanCache(tempfile.mkdtemp())
    >>> cache.hits, cache.misses
    (0, 0)
    """

    directory: Path
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).expanduser()

    @property
    def scratch_directory(self) -> Path:
        """Where kernel scratch measurements persist beside the plans (``annotate.scratch``)."""
        return self.directory / "scratch"

    @property
    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}

    @property
    def traced_directory(self) -> Path:
        """Where results found before tracing are stored (``planning.trace_key``), beside the plans."""
        return self.directory / "traced"

    @property
    def compiled_directory(self) -> Path:
        """Where the plans of compiles torch's caches may answer are stored (``cached_compile``)."""
        return self.directory / "compiled"

    def get_traced(self, key: str) -> Any | None:
        """What ``put_traced`` stored under ``key`` (a pre-trace key), or None; a hit is counted
        in ``hits``, a miss is not (the traced path that follows looks the plan up again)."""
        found = self._read_pickled(self.traced_directory, key)
        if found is not None:
            logger.info("plan cache hit %s in %s before tracing: skipping the trace and the solve (%d hits, %d "
                        "misses)", key[:12], self.traced_directory, self.hits, self.misses)
        return found

    def put_traced(self, key: str, result: Any) -> None:
        """Store ``result`` (remat_pass's own frozen records: a ``PlanReport`` with its plan and
        problem) under a pre-trace ``key``; pickled, read back by ``get_traced`` alone."""
        self._write_pickled(self.traced_directory, key, result)

    def get_compiled(self, identity: str, *, count: bool = True) -> Any | None:
        """What ``put_compiled`` stored for a compile's ``identity`` (``compiled_key``): its plan,
        its refusal, a fit's outcome (``inductor_fit.FitOutcome``), or None; a hit is counted in
        ``hits`` when ``count``."""
        found = self._read_pickled(self.compiled_directory, identity, count=count)
        if found is not None and count:
            logger.info("plan cache hit %s in %s: a compile answered before, its %s read back (%d hits, %d misses)",
                        identity[:12], self.compiled_directory, type(found).__name__, self.hits, self.misses)
        return found

    def put_compiled(self, identity: str, outcome: Any) -> None:
        """Store the plan (with its problem), the refusal or the fit's outcome of the compile ``identity``
        (remat_pass's own records only: ``_RecordUnpickler`` reads nothing else back)."""
        self._write_pickled(self.compiled_directory, identity, outcome)

    def _read_pickled(self, directory: Path, key: str, *, count: bool = True) -> Any | None:
        path = directory / f"{key}.pickle"
        try:
            with path.open("rb") as handle:
                found = _RecordUnpickler(handle).load()
        except FileNotFoundError:
            return None
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
                ValueError) as error:
            logger.warning("plan cache file %s is unreadable (%s); planning again", path, error)
            return None
        self.hits += count
        return found

    @staticmethod
    def _write_pickled(directory: Path, key: str, record: Any) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("wb", dir=directory, suffix=".tmp", delete=False) as handle:
                pickle.dump(record, handle, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(handle.name, directory / f"{key}.pickle")  # atomic: readers never see half a file
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as error:
            logger.warning("could not write the plan cache in %s: %s", directory, error)

    def get(self, problem: Problem, options: Any, key: str | None = None) -> tuple[Plan, dict[str, Any]] | None:
        """The stored plan for ``problem`` under ``options`` and the budget it was made for, or None
        (``key``: ``cache_key(problem, options)`` where the caller has it, so a miss that is then
        stored hashes the problem once)."""
        key = key or cache_key(problem, options)
        path = self.directory / f"{key}.json"
        try:
            record = json.loads(path.read_text())
            plan = _plan_from(problem, record)
            if _measured(problem):
                plan = _checked_and_repriced(plan, record["seconds"], bounded=not options.offload)
        except FileNotFoundError:
            plan = None
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("plan cache file %s is unreadable (%s); solving again", path, error)
            plan = None
        if plan is None:
            self.misses += 1
            logger.info("plan cache miss %s in %s (%d hits, %d misses)", key[:12], self.directory, self.hits,
                        self.misses)
            return None
        self.hits += 1
        logger.info("plan cache hit %s in %s: skipping the solve (%d hits, %d misses)", key[:12], self.directory,
                    self.hits, self.misses)
        return plan, record["budget"]

    def put(self, problem: Problem, options: Any, plan: Plan, budget: dict[str, Any], key: str | None = None) -> None:
        """Store ``plan`` (and the budget it was made for, in ``Budget``'s fields and kind)."""
        key = key or cache_key(problem, options)
        record = {"format": FORMAT, "plan": _plan_fields(plan), "budget": budget}
        if _measured(problem):
            record["seconds"] = [value.recompute_seconds for value in problem.values]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as handle:
                json.dump(record, handle)
            os.replace(handle.name, self.directory / f"{key}.json")  # atomic: readers never see half a file
        except OSError as error:
            logger.warning("could not write the plan cache in %s: %s", self.directory, error)


class _RecordUnpickler(pickle.Unpickler):
    """Reads back only what ``put_traced`` writes: remat_pass's classes, containers and the
    helpers pickle rebuilds objects with; any other global (a function a crafted file would
    call) is refused, so a cache file cannot run code."""

    _BUILTINS = frozenset({"frozenset", "set", "tuple", "list", "dict", "int", "float", "complex", "str", "bytes",
                           "bool", "slice", "object"})
    _COPYREG = frozenset({"_reconstructor", "__newobj__", "__newobj_ex__"})

    def find_class(self, module: str, name: str) -> Any:
        if (module == "builtins" and name in self._BUILTINS) or (module == "copyreg" and name in self._COPYREG):
            return super().find_class(module, name)
        if module.split(".")[0] == "remat_pass":  # checked before importing anything
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not a remat_pass record")


def _plan_fields(plan: Plan) -> dict[str, Any]:
    """Every field of the plan but its problem; sets as sorted lists (marked, to come back as sets)."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if f.name == "problem":
            continue
        if isinstance(value, (set, frozenset)):
            fields[f.name] = {"set": sorted(value)}
        elif isinstance(value, enum.Enum):
            fields[f.name] = value.value
        else:
            fields[f.name] = value
    return fields


def _plan_from(problem: Problem, record: dict[str, Any]) -> Plan:
    if record.get("format") != FORMAT:
        raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
    fields = {name: frozenset(value["set"]) if isinstance(value, dict) and "set" in value else value
              for name, value in record["plan"].items()}
    return Plan(problem, **fields)  # Plan.check() rejects a record that does not fit the problem


def _checked_and_repriced(plan: Plan, solved_seconds: list[float], bounded: bool) -> Plan | None:
    """``plan`` (built on this run's measured problem), solved when the values cost
    ``solved_seconds``: None if its simulated peak rose, else re-priced with an honest status
    and gap (see the module; ``bounded``: the planner's objective was recompute time alone)."""
    problem = plan.problem
    if len(solved_seconds) != len(problem.values):
        raise ValueError(f"{len(solved_seconds)} stored costs for {len(problem.values)} values")
    if [value.recompute_seconds for value in problem.values] == solved_seconds:
        return plan
    if plan.predicted_peak_bytes is not None:
        peak = simulate_plan(problem, plan).peak_bytes
        if peak > plan.predicted_peak_bytes:
            logger.info("plan cache: with this run's measured costs the cached plan peaks at %d bytes, above the "
                        "%d it was planned with; solving again", peak, plan.predicted_peak_bytes)
            return None
        plan = dataclasses.replace(plan, predicted_peak_bytes=peak)
    then = dataclasses.replace(problem, values=tuple(
        dataclasses.replace(value, recompute_seconds=seconds) for value, seconds in zip(problem.values, solved_seconds)))
    cost_then = dataclasses.replace(plan, problem=then).predicted_extra_seconds
    cost_now = plan.predicted_extra_seconds
    gap = None
    if bounded and plan.gap is not None and math.isfinite(plan.gap):
        rho = min((value.recompute_seconds / seconds for value, seconds in zip(problem.values, solved_seconds)
                   if value.recomputable and seconds > 0), default=1.0)
        gap = relative_gap(cost_now, rho * cost_then * (1 - plan.gap))
    status = plan.status
    if status is Status.OPTIMAL and (gap is None or gap > CLOSED_GAP):
        status = Status.FEASIBLE
    logger.info("plan cache: re-priced with this run's measured costs: +%.6g s (planned at +%.6g s), gap %s",
                cost_now, cost_then, "unknown" if gap is None else f"{gap:.2%}")
    return dataclasses.replace(plan, status=status, gap=gap)


_DEFAULT_CACHES: dict[Path, PlanCache] = {}

OFF_WORDS = ("off", "0", "false", "no", "none")
"""What turns the cache off where it is named by a string (``--plan-cache``, ``REMAT_PASS_PLAN_CACHE``)."""


def from_text(text: str) -> str | bool:
    """A plan cache named by a string: "" the default (True), one of ``OFF_WORDS`` none (False),
    anything else a directory."""
    text = text.strip()
    return True if not text else False if text.lower() in OFF_WORDS else text


def as_plan_cache(value: PlanCache | str | os.PathLike[str] | bool | None) -> PlanCache | None:
    """A ``PlanCache`` from a cache or a directory; ``True`` is the one in ``DEFAULT_DIRECTORY``
    (one object per process, so its ``hits``/``misses`` count every front door's); ``False`` and
    None are no caching."""
    if value is None or value is False:
        return None
    if isinstance(value, PlanCache):
        return value
    if value is True:
        directory = default_directory()
        return _DEFAULT_CACHES.setdefault(directory, PlanCache(directory))
    if isinstance(value, (str, os.PathLike)):
        return PlanCache(Path(value))
    raise TypeError(f"plan_cache must be a PlanCache, a directory path, True, False or None, got {type(value).__name__}")


__all__ = ["DEFAULT_DIRECTORY", "OFF_WORDS", "PlanCache", "Refusal", "Renewed", "Unplanned", "from_text", "as_plan_cache", "cache_key", "canonical",
           "code_digest", "compiled_key",
           "default_directory", "planning_versions", "problem_digest"]
