"""Inductor as the inner compiler: our partitioner inside it, and its caches kept working.

Inductor takes a custom partitioner (``torch._inductor.config.custom_partitioner_fn``) and asks
it for an identity (``uuid()``) that goes into the keys of its two caches: AOTAutograd's cache
(keyed by the Dynamo graph and the configs) and the FX graph cache (keyed by each compiled graph).
An identity of None would let a compile made under one budget answer a compile under another, so
with no identity both caches are off for our compiles, and every first call in a new process
traces the joint graph, plans, rewrites and compiles again: under a peak budget every fitting
compile again (a 12-layer HF GPT-2's restart took 151.7 s against torch.compile's own 6.6 s;
``python -m benchmarks.planning_time --restart remat``, benchmarks/SCALING.md "Restarting a job").

With an identity (``CompiledPlans.compiled_identity``: the graph and everything that plans it),
the caches work as they do for torch.compile: a second process's compile of the same graph under
the same settings is answered by AOTAutograd's cache without tracing the joint graph, so without
calling the partitioner, so without a plan. The plan is therefore stored beside it under the same
identity (``PlanCache.put_compiled``) and handed back on such a hit
(``CompiledPlans.reuse_compiled``); a hit whose plan is not stored (the plan cache was emptied,
Inductor's was not) compiles and plans again under a new identity (``CompiledPlans.renew_identity``),
which later compiles of it are given: the program in the caches may be another plan's (the searches
are time-limited), and a later hit must not pair it with the plan made now. A compile the planner
refused leaves nothing in Inductor's caches; its refusal is stored the same way and raised again
before tracing (``CompiledPlans.refuse_as_before``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import fx

from ..compat import PartitionerBase
from .late_addmm import post_grad_pass_for_our_compiles
from .precompiled import note_candidate

logger = logging.getLogger(__name__)


class CompiledPlans(Protocol):
    """What a backend tells the Inductor compile about its plans (``RematBackend`` implements it)."""

    def compiled_identity(self, graph: str) -> str | None:
        """The identity of compiling the graph whose ``graph_digest`` is ``graph`` under the
        settings in force now; None never lets a cache answer."""

    def reuse_compiled(self, identity: str) -> bool:
        """Inductor's caches answered without partitioning: take the plan stored under
        ``identity`` as this compile's; False if none is stored."""

    def remember_unplanned(self, identity: str) -> None:
        """The compile ``identity`` had nothing to partition (no backward): a cache hit of it
        needs no plan."""

    def refuse_as_before(self, identity: str) -> None:
        """Raise the refusal stored under ``identity``, if one is: a refused compile leaves
        nothing in Inductor's caches, and refusing again is the same answer without the trace."""

    def renew_identity(self, identity: str) -> str:
        """A new identity for the compile ``identity``, whose program in Inductor's caches has no
        plan stored: later compiles of the same graph and settings are given the new one."""


class Compiling(Protocol):
    """The compile in progress on this thread: its identity, and whether the partitioner ran."""

    identity: str | None
    partitioned: bool


def _tensor_fields(value: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(value.shape), tuple(value.stride()), str(value.dtype), value.device.type, value.requires_grad)


def graph_digest(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """SHA-256 of a Dynamo graph's code, its inputs' shapes, strides, dtypes, devices and
    ``requires_grad``, and its tensor attributes' metadata: which graph a compile is of.
    AOTAutograd's own key sees more (the attributes' values among them); two graphs equal here
    and different there would share a stored plan, so the plan reported for the second could be
    the first's (the compiled program is AOTAutograd's, always the right one)."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        digest.update(repr(_tensor_fields(value) if isinstance(value, torch.Tensor) else str(value)).encode())
    for name, value in sorted(gm.state_dict(keep_vars=True).items()):
        digest.update(repr((name, _tensor_fields(value))).encode())
    return digest.hexdigest()


def _autograd_cache_hits() -> int:
    """How many compiles AOTAutograd's cache has answered in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def _needs_backward(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


class InductorPartitioner(PartitionerBase):  # type: ignore[misc,valid-type]
    """Our partition function in the shape Inductor accepts as ``custom_partitioner_fn``.

    Inductor pickles its config into its cache keys and deep-copies it when patched: a pickle is
    the identity alone (what the key needs; the closure over the planner cannot be pickled), and
    a deep copy is this object (it holds no state a compile changes)."""

    def __init__(self, partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]], identity: str | None) -> None:
        self._partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]] | None = partition
        self._identity = identity

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        if self._partition is None:
            raise RuntimeError("a remat_pass partitioner read back from a pickle has no planner to call")
        return self._partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str | None:
        return self._identity

    def __getstate__(self) -> dict[str, Any]:
        return {"identity": self._identity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._partition, self._identity = None, state["identity"]

    def __deepcopy__(self, memo: dict[int, Any]) -> "InductorPartitioner":
        return self


def compile_with_inductor(gm: fx.GraphModule, example_inputs: list[Any],
                          partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
                          compiling: Compiling, plans: CompiledPlans | None) -> Any:
    """``compile_fx`` of ``gm`` with ``partition`` as Inductor's partitioner; cacheable by
    Inductor's caches when ``plans`` gives the compile an identity (see the module). Each compile
    is a candidate for torch's precompile (``capture.precompiled``)."""
    compiled = _compile_fx(gm, example_inputs, partition, compiling, plans)
    note_candidate(compiled)
    return compiled


def _compile_fx(gm: fx.GraphModule, example_inputs: list[Any],
                partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
                compiling: Compiling, plans: CompiledPlans | None) -> Any:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    identity = (plans.compiled_identity(graph_digest(gm, example_inputs))
                if plans is not None and _needs_backward(example_inputs) else None)
    compiling.identity, compiling.partitioned = identity, False
    partitioner = InductorPartitioner(partition, identity)
    # The pass goes in compile_fx's own patches, which Inductor applies again around the backward's
    # compile (lazy: at the first backward, outside this call).
    passes = {"post_grad_custom_post_pass": post_grad_pass_for_our_compiles(inductor_config.post_grad_custom_post_pass)}
    if plans is None or identity is None:
        # Without an identity the caches could hand back a compile planned under other settings.
        with inductor_config.patch(custom_partitioner_fn=partitioner, fx_graph_cache=False):
            return compile_fx(gm, example_inputs, config_patches=passes)
    plans.refuse_as_before(identity)
    hits = _autograd_cache_hits()
    with inductor_config.patch(custom_partitioner_fn=partitioner):
        compiled = compile_fx(gm, example_inputs, config_patches=passes)
    if compiling.partitioned:
        return compiled
    if _autograd_cache_hits() == hits:  # compiled, and nothing to partition (no backward)
        plans.remember_unplanned(identity)
        return compiled
    if plans.reuse_compiled(identity):
        logger.info("Inductor's caches answered the compile %s: no trace of the joint graph, no plan made, "
                    "what was stored under it reused", identity[:12])
        return compiled
    # The program is another process's plan, and a plan made now may differ (time-limited searches):
    # compiled again under a new identity, so that no later hit pairs that program with this plan.
    renewed = plans.renew_identity(identity)
    logger.info("Inductor's caches answered the compile %s but no plan is stored under it; compiling and "
                "planning again as %s", identity[:12], renewed[:12])
    compiling.identity, compiling.partitioned = renewed, False
    with inductor_config.patch(custom_partitioner_fn=InductorPartitioner(partition, renewed)):
        compiled = compile_fx(gm, example_inputs, config_patches=passes)
    if not compiling.partitioned:  # nothing to partition after all: the next hit needs no plan
        plans.remember_unplanned(renewed)
    return compiled


__all__ = ["CompiledPlans", "InductorPartitioner", "compile_with_inductor", "graph_digest"]
