"""Inductor as the inner compiler: our partitioner inside it, and its caches kept working.

Inductor takes a custom partitioner (``torch._inductor.config.custom_partitioner_fn``) and asks
it for an identity (``uuid()``) that goes into the keys of its two caches: AOTAutograd's cache
(keyed by the Dynamo graph and the configs) and the FX graph cache (keyed by each compiled graph).
With no identity both caches are off for our compiles, and every first call in a new process
traces the joint graph, plans, rewrites and compiles again: under a peak budget every fitting
compile again (a 12-layer HF GPT-2's restart took 151.7 s against torch.compile's own 6.6 s;
``python -m benchmarks.planning_time --restart remat``, benchmarks/SCALING.md "Restarting a job").
With one, the caches work as they do for torch.compile, and a hit is paired with its stored plan
(``cached_compile``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import fx

from ..compat import PartitionerBase, donated_buffers_scope
from .cached_compile import CompiledPlans, Compiling, compile_cached, graph_digest, needs_backward
from .donated_buffers import stop_donating_if_saved_tensors_alias
from .late_addmm import post_grad_pass_for_our_compiles
from .precompiled import note_candidate


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
        forward, backward = self._partition(gm, joint_inputs, **kwargs)
        stop_donating_if_saved_tensors_alias(forward, kwargs["num_fwd_outputs"])
        return forward, backward

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

    # The pass goes in compile_fx's own patches, which Inductor applies again around the backward's
    # compile (lazy: at the first backward, outside this call).
    passes = {"post_grad_custom_post_pass": post_grad_pass_for_our_compiles(inductor_config.post_grad_custom_post_pass)}

    def compile_as(identity: str | None) -> Any:
        # Without an identity the caches could hand back a compile planned under other settings.
        uncached = {} if identity is not None else {"fx_graph_cache": False}
        # Donated buffers stay on unless the partition saves tensors that share a storage (``donated_buffers``):
        # it then turns them off, for this compile only.
        with inductor_config.patch(custom_partitioner_fn=InductorPartitioner(partition, identity), **uncached), \
                donated_buffers_scope():
            return compile_fx(gm, example_inputs, config_patches=passes)

    graph = graph_digest(gm, example_inputs) if needs_backward(example_inputs) else None
    return compile_cached(graph, compiling, plans, compile_as)


__all__ = ["InductorPartitioner", "compile_with_inductor"]
