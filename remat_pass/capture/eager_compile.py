"""The eager inner compiler: the rewritten graphs run as FX Python code, stored where torch can.

``inner="eager"`` runs the planned forward and backward as generated Python (boxed, so that each
saved tensor is freed as soon as backward is done with it). torch.compile's caches held Inductor's
programs only, so a restarted job traced, planned and rewrote every eager graph again, even under
torch's precompile (``TORCH_CACHING_PRECOMPILE=1``), which saved no entry for them ("Backend not
found" at the save). Where AOTAutograd's cache bundles the compiled graphs into its entries (under
precompile, or with ``torch._functorch.config.bundled_autograd_cache``), it can store a GraphModule
itself (``RegionalOutputCode``, as torch's regional Inductor does), so the eager compile is made
cacheable there: our partitioner's identity is put in the cache key (``cached_compile``; carried in
Inductor's ``custom_partitioner_fn``, whose ``uuid()`` AOTAutograd's key reads, although Inductor
compiles nothing here), a hit is paired with its stored plan, and precompile saves the program
returned (``capture.precompiled``). A graph the cache cannot store (an op outside ``STORED_OPS``:
torch's ``GraphPickler`` refuses it, and torch logs a warning) runs as compiled, and a restart traces
it again.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import fx

from ..compat import aot_cache_bundles_graphs, storable_graph_compiler, use_boxed_codegen
from .cached_compile import CompiledPlans, Compiling, compile_cached, graph_digest, needs_backward
from .inductor_compile import InductorPartitioner
from .precompiled import note_candidate

Partition = Callable[..., "tuple[fx.GraphModule, fx.GraphModule]"]

# What a stored graph may call: ATen, and our own ops (``torch.ops.remat_pass``, registered when
# remat_pass is imported, as it is in any process that calls it). Of the nodes' metadata only the
# user's stack trace is kept, for errors: the fake values (``val``), which a restart does not read,
# do not all pickle (views made by the rewrite's fresh fake values fail), nor do our annotations.
STORED_OPS = ("torch.ops.aten.", "torch.ops.remat_pass.")
STORED_METADATA = ("stack_trace",)


def _boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` generated to take its arguments as one list it clears (boxed calling): the graph can
    drop each saved tensor after its last use; an unboxed call would keep every argument alive
    until the whole graph returns."""
    use_boxed_codegen(gm)
    return gm


def _boxed_eager(gm: fx.GraphModule, _example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Run a graph as its boxed generated Python."""
    forward = _boxed(gm).forward

    def run(args: list[Any]) -> Any:
        return forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _aot_eager(partition: Partition, compiler: Any) -> Callable[[fx.GraphModule, list[Any]], Any]:
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition)


def compile_eager(gm: fx.GraphModule, example_inputs: list[Any], partition: Partition,
                  compiling: Compiling, plans: CompiledPlans | None) -> Any:
    """AOTAutograd of ``gm`` with ``partition`` as its partitioner, the two graphs run as Python;
    cacheable by AOTAutograd's cache, and saved by precompile, where torch bundles graphs and
    ``plans`` gives the compile an identity (see the module)."""
    storable = storable_graph_compiler(_boxed, STORED_OPS, STORED_METADATA) if aot_cache_bundles_graphs() else None

    def compile_as(identity: str | None) -> Any:
        if identity is None:  # no identity, no cache: a compile under other settings could answer it
            return _aot_eager(partition, _boxed_eager)(gm, example_inputs)
        from torch._inductor import config as inductor_config

        with inductor_config.patch(custom_partitioner_fn=InductorPartitioner(partition, identity)):
            return _aot_eager(partition, storable)(gm, example_inputs)

    cacheable = storable is not None and needs_backward(example_inputs)
    graph = graph_digest(gm, example_inputs, "eager") if cacheable else None
    compiled = compile_cached(graph, compiling, plans, compile_as)
    note_candidate(compiled)
    return compiled


__all__ = ["compile_eager"]
