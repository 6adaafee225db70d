"""One compile of a Dynamo graph that torch's caches may answer, with its plan kept beside it.

AOTAutograd's cache (keyed by the Dynamo graph and the configs) answers a compile it has seen
without tracing the joint graph, so without calling our partitioner, so without a plan. Both inner
compilers can be answered by it: Inductor's always (``inductor_compile``), the eager one where torch
bundles the compiled graphs into the cache entry (``eager_compile``: under torch's precompile or
``torch._functorch.config.bundled_autograd_cache``). The partitioner's identity goes into the key
(``CompiledPlans.compiled_identity``: the graph, the inner compiler and everything that plans it);
an identity of None would let a compile made under one budget answer a compile under another, so
without one the caches are kept out of the compile.

The plan is therefore stored beside the program under the same identity (``PlanCache.put_compiled``)
and handed back on a hit (``CompiledPlans.reuse_compiled``). A hit whose plan is not stored (the
plan cache was emptied, torch's was not) compiles and plans again under a new identity
(``CompiledPlans.renew_identity``), which later compiles of it are given: the program in the caches
may be another plan's (the searches are time-limited), and a later hit must not pair it with the
plan made now. A compile the planner refused leaves nothing in the caches; its refusal is stored
the same way and raised again before tracing (``CompiledPlans.refuse_as_before``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import fx

logger = logging.getLogger(__name__)


class CompiledPlans(Protocol):
    """What a backend tells a cacheable compile about its plans (``RematBackend`` implements it)."""

    def compiled_identity(self, graph: str) -> str | None:
        """The identity of compiling the graph whose ``graph_digest`` is ``graph`` under the
        settings in force now; None never lets a cache answer."""

    def reuse_compiled(self, identity: str) -> bool:
        """torch's caches answered without partitioning: take the plan stored under
        ``identity`` as this compile's; False if none is stored."""

    def remember_unplanned(self, identity: str) -> None:
        """The compile ``identity`` had nothing to partition (no backward): a cache hit of it
        needs no plan."""

    def refuse_as_before(self, identity: str) -> None:
        """Raise the refusal stored under ``identity``, if one is: a refused compile leaves
        nothing in torch's caches, and refusing again is the same answer without the trace."""

    def renew_identity(self, identity: str) -> str:
        """A new identity for the compile ``identity``, whose program in torch's caches has no
        plan stored: later compiles of the same graph and settings are given the new one."""


class Compiling(Protocol):
    """The compile in progress on this thread: its identity, and whether the partitioner ran."""

    identity: str | None
    partitioned: bool


def _tensor_fields(value: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(value.shape), tuple(value.stride()), str(value.dtype), value.device.type, value.requires_grad)


def graph_digest(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler: str = "inductor") -> str:
    """SHA-256 of a Dynamo graph's code, its inputs' shapes, strides, dtypes, devices and
    ``requires_grad``, its tensor attributes' metadata, and the inner compiler that compiles it:
    which compile it is. AOTAutograd's own key sees more (the attributes' values among them) but not
    the inner compiler, so the compiler must be in our identity. Two graphs equal here and different
    there would share a stored plan, so the plan reported for the second could be the first's (the
    compiled program is AOTAutograd's, always the right one)."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        digest.update(repr(_tensor_fields(value) if isinstance(value, torch.Tensor) else str(value)).encode())
    for name, value in sorted(gm.state_dict(keep_vars=True).items()):
        digest.update(repr((name, _tensor_fields(value))).encode())
    if compiler != "inductor":  # Inductor's digests predate the eager compiler's: kept as they were
        digest.update(f"compiled by {compiler}".encode())
    return digest.hexdigest()


def _autograd_cache_hits() -> int:
    """How many compiles AOTAutograd's cache has answered in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def needs_backward(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def compile_cached(graph: str | None, compiling: Compiling, plans: CompiledPlans | None,
                   compile_as: Callable[[str | None], Any]) -> Any:
    """Compile with ``compile_as(identity)``, the identity of the graph digested as ``graph``
    (None: not cacheable), pairing a cache hit with the plan stored under it (see the module)."""
    identity = plans.compiled_identity(graph) if plans is not None and graph is not None else None
    compiling.identity, compiling.partitioned = identity, False
    if plans is None or identity is None:
        return compile_as(None)
    plans.refuse_as_before(identity)
    hits = _autograd_cache_hits()
    compiled = compile_as(identity)
    if compiling.partitioned:
        return compiled
    if _autograd_cache_hits() == hits:  # compiled, and nothing to partition (no backward)
        plans.remember_unplanned(identity)
        return compiled
    if plans.reuse_compiled(identity):
        logger.info("torch's caches answered the compile %s: no trace of the joint graph, no plan made, "
                    "what was stored under it reused", identity[:12])
        return compiled
    # The program is another process's plan, and a plan made now may differ (time-limited searches):
    # compiled again under a new identity, so that no later hit pairs that program with this plan.
    renewed = plans.renew_identity(identity)
    logger.info("torch's caches answered the compile %s but no plan is stored under it; compiling and "
                "planning again as %s", identity[:12], renewed[:12])
    compiling.identity, compiling.partitioned = renewed, False
    compiled = compile_as(renewed)
    if not compiling.partitioned:  # nothing to partition after all: the next hit needs no plan
        plans.remember_unplanned(renewed)
    return compiled


__all__ = ["CompiledPlans", "Compiling", "compile_cached", "graph_digest", "needs_backward"]
