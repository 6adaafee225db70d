"""torch's precompile stores, for each Dynamo graph, the program our backend returned for it.

torch's experimental precompile (``TORCH_CACHING_PRECOMPILE=1``, then
``torch.compiler.save_cache_artifacts()``) saves Dynamo's bytecode and, for each graph, the
AOTAutograd cache entry last recorded under the graph's backend id (``gm._backend_id``); a
restarted process installs them and runs the step without tracing or calling the backend
(a 2-layer GPT's first step: 0.01 s against 1.7-2.2 s traced with the eager inner compiler and 28-32 s
compiled by Inductor: ``benchmarks/results/precompile_restart/probe_optimize_inners.txt``, before the eager
compiler's graphs could be saved). Inductor's compiles record an entry, and the eager compiler's where a
plan cache gives them an identity (``capture.eager_compile``).

Our backend may compile several Inductor candidates for one graph (the peak fit in
``runtime.inductor_fit``, the loss whole or chunked) and return any of them, or fall back to
``inner="eager"``. Each candidate records its entry in turn, so the saved one would be the last
compiled, not the one chosen, and a restart could run a plan measured over the budget.
``program_stored_as_returned`` wraps one call of the backend: ``note_candidate`` remembers the
entry each compile recorded, and when the backend returns, the returned program's entry is
recorded again; where it has none (an eager compile without an identity), the graph is withdrawn
from precompile, so a restart traces it again instead of running another candidate.

torch keys the saved step by the function's name and first line alone (``CompilePackage.source_id_from_fn``),
not by the backend or its settings: a restarted job given another budget would run the step planned
under the old one. The backend cannot see that restart (it is not called), so it warns once per process
when it compiles under precompile, naming the directory to delete.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from torch import fx

from ..compat import hold_precompile_artifact, inductor_cache_dir, precompile_artifact


@dataclass
class _Candidates:
    """The entries recorded for one Dynamo graph during one call of the backend."""

    backend_id: str
    before: Any  # what was recorded when the call began
    last_seen: Any  # a compile that records nothing leaves this: it is not that compile's entry
    entry_of: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(program) -> (program, entry)

    def note(self, compiled: Any) -> None:
        entry = precompile_artifact(self.backend_id)
        if entry is not None and entry is not self.last_seen:
            self.entry_of[id(compiled)] = (compiled, entry)
            self.last_seen = entry

    def settle(self, returned: Any) -> Any:
        noted = self.entry_of.get(id(returned))
        if noted is not None and noted[0] is returned:
            if precompile_artifact(self.backend_id) is not noted[1]:
                hold_precompile_artifact(self.backend_id, noted[1])
        elif precompile_artifact(self.backend_id) is not self.before:
            hold_precompile_artifact(self.backend_id, None)  # recorded now, by a program not returned
        return returned


_CURRENT: ContextVar[_Candidates | None] = ContextVar("remat_precompile_candidates", default=None)


@contextlib.contextmanager
def program_stored_as_returned(gm: fx.GraphModule) -> Iterator[Callable[[Any], Any]]:
    """Around one call of the backend for Dynamo's ``gm``: yields ``settle``, to be applied to what
    the backend returns (it returns its argument). A graph Dynamo packages for no precompile has
    no backend id; then ``settle`` does nothing."""
    backend_id = getattr(gm, "_backend_id", None)
    if backend_id is None:
        yield lambda returned: returned
        return
    _warn_keyed_by_function_once()
    before = precompile_artifact(backend_id)
    candidates = _Candidates(backend_id, before, before)
    token = _CURRENT.set(candidates)
    try:
        yield candidates.settle
    finally:
        _CURRENT.reset(token)


@functools.cache
def _warn_keyed_by_function_once() -> None:
    warnings.warn(
        f"torch's precompile (TORCH_CACHING_PRECOMPILE) is on: it stores the compiled step under the function's name "
        f"and line alone, not remat_pass's budget or settings, and a restarted job runs it without calling "
        f"remat_pass. After changing the budget or settings, delete {os.path.join(inductor_cache_dir(), 'dynamo')}, "
        f"or the step planned under the old ones runs.", stacklevel=2)


def note_candidate(compiled: Any) -> None:
    """Called after each compile inside the backend (Inductor's or the eager one): remembers the entry it recorded."""
    candidates = _CURRENT.get()
    if candidates is not None:
        candidates.note(compiled)


__all__ = ["note_candidate", "program_stored_as_returned"]
