"""A plan cache on disk, so that a restarted job skips the solve.

Planning a graph is capture + annotate (seconds) and a solve (up to the time limit). The solve is
a pure function of the torch-free ``Problem`` and the planning inputs, so its answer can be
stored: ``PlanCache(directory)`` keeps one small JSON file per key, where the key is a SHA-256 of

* the problem, every field of it (each value's op, inputs, storage, bytes, recompute cost, tags,
  module path; what backward reads and in which steps; the device): the graph as planners see it;
* the planning inputs, every field of ``PlanOptions`` (budget, budget kind, solver, device
  profile, time limit, solver options, offload, what to do when a budget is infeasible);
* the versions of remat_pass and torch (a new release may plan differently).

Any change of these is a miss and a new solve. Hits and misses are logged at INFO and counted
(``cache.hits``, ``cache.misses``). A file that cannot be read is a miss (and is overwritten);
a file that cannot be written is a warning, never a failed step. Pass the cache (or a directory)
to ``optimize(..., plan_cache=...)`` or ``backend(..., plan_cache=...)``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from remat_pass.solvers.problem import Plan, Problem

logger = logging.getLogger(__name__)

FORMAT = 1


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


def problem_digest(problem: Problem) -> str:
    """SHA-256 of every field of the problem (values, storages, reads, steps, device, ...)."""
    return hashlib.sha256(json.dumps(_canonical(problem), separators=(",", ":")).encode()).hexdigest()


def _planning_inputs(options: Any) -> dict[str, Any]:
    """Every field of ``PlanOptions`` but the cache itself, and the versions that plan."""
    fields = {f.name: _canonical(getattr(options, f.name)) for f in dataclasses.fields(options) if f.name != "plan_cache"}
    return {**fields, "remat_pass": _version("remat-pass"), "torch": _version("torch"), "format": FORMAT}


def cache_key(problem: Problem, options: Any) -> str:
    """The file name a plan for ``problem`` under ``options`` is stored as."""
    record = {"problem": problem_digest(problem), "options": _planning_inputs(options)}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


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
    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}

    def get(self, problem: Problem, options: Any) -> tuple[Plan, dict[str, Any]] | None:
        """The stored plan for ``problem`` under ``options`` and the budget it was made for, or None."""
        key = cache_key(problem, options)
        path = self.directory / f"{key}.json"
        try:
            record = json.loads(path.read_text())
            plan = _plan_from(problem, record)
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

    def put(self, problem: Problem, options: Any, plan: Plan, budget: dict[str, Any]) -> None:
        """Store ``plan`` (and the budget it was made for, in ``Budget``'s fields and kind)."""
        key = cache_key(problem, options)
        record = {"format": FORMAT, "plan": _plan_fields(plan), "budget": budget}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as handle:
                json.dump(record, handle)
            os.replace(handle.name, self.directory / f"{key}.json")  # atomic: readers never see half a file
        except OSError as error:
            logger.warning("could not write the plan cache in %s: %s", self.directory, error)


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


def as_plan_cache(value: PlanCache | str | os.PathLike[str] | None) -> PlanCache | None:
    """A ``PlanCache`` from a cache or a directory; None stays None (no caching)."""
    if value is None or isinstance(value, PlanCache):
        return value
    if isinstance(value, (str, os.PathLike)):
        return PlanCache(Path(value))
    raise TypeError(f"plan_cache must be a PlanCache, a directory path or None, got {type(value).__name__}")


__all__ = ["PlanCache", "as_plan_cache", "cache_key", "problem_digest"]
