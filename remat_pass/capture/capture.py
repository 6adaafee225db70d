"""Stage 1: capture the joint forward+backward graph through TorchDynamo and AOTAutograd.

AOTAutograd traces forward and backward together into one functional graph and then asks a
*partition function* to split it into a forward graph (which returns the outputs plus what
backward needs) and a backward graph. That hook is exactly where keep/recompute is decided,
so capture does not trace anything itself: it builds a dynamo backend whose partition
function hands each joint graph to a planner (``JointGraphHandler``) and returns the planner's
pair of graphs. ``optimize`` and the ``torch.compile`` backend both go through
``make_dynamo_backend``; each subgraph between graph breaks is partitioned on its own.

The inner compiler compiles the two rewritten graphs: ``"eager"`` runs them as FX Python code
(boxed, so that saved tensors are freed as soon as backward is done with them: ``eager_compile``),
``"inductor"`` lets Inductor compile them with our partitioner installed as its custom partitioner
(``inductor_compile``). Both may be answered by torch's caches (``cached_compile``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from .capture_errors import capture_failure
from .loss_chunking import ChunkLoss, chunk_losses, copied
from .cached_compile import CompiledPlans
from .eager_compile import compile_eager
from .frozen_objects import older_objects_frozen
from .inductor_compile import compile_with_inductor
from ..compat import capture_config, has_custom_partitioner, is_fake
from ..errors import CaptureError
from .state import untouched

logger = logging.getLogger(__name__)

INNER_COMPILERS = ("eager", "inductor")


@dataclass(frozen=True)
class JointGraph:
    """One joint forward+backward graph as AOTAutograd hands it to the partitioner.

    ``module``'s output node returns the ``num_fwd_outputs`` forward outputs (user outputs and
    updated buffers) followed by the gradients. ``partition_kwargs`` are the extra keyword
    arguments AOTAutograd passed; they go back unchanged when the graphs are extracted.
    ``compiler`` is the inner compiler that will run the two graphs made of it ("eager" or
    "inductor"): Inductor fuses what eager runs op by op, and planning reads which
    (``planning.fused_free``).
    """

    module: fx.GraphModule
    num_fwd_outputs: int
    partition_kwargs: Mapping[str, Any] = field(default_factory=dict)
    step_inputs: StepInputs | None = field(default=None, repr=False, compare=False)
    compiler: str = "eager"
    identity: str | None = None  # the compile's identity in Inductor's caches (``inductor_compile``)


class StepInputs:
    """The real inputs dynamo compiled a graph for (``op_timing`` runs the forward on them), held
    weakly: a plan, a traced step or a cached graph must not keep a step's tensors alive. They
    are alive while the graph is partitioned, which is when they are read."""

    def __init__(self, gm: torch.nn.Module, inputs: Sequence[Any]) -> None:
        self._module = weakref.ref(gm)
        self._inputs = [weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in inputs]

    def inputs(self) -> list[Any] | None:
        """The inputs in dynamo's order (AOTAutograd's ``PlainAOTInput.idx``); None once any is gone."""
        found = [x() if isinstance(x, weakref.ref) else x for x in self._inputs]
        return None if any(x is None and isinstance(r, weakref.ref) for x, r in zip(found, self._inputs)) else found

    def are_fake(self) -> bool:
        """True when the step was traced from fake tensors (a meta model planned by ``plan``):
        nothing real exists to run a kernel on, and what would run here is not what the plan is for."""
        return any(is_fake(x() if isinstance(x, weakref.ref) else x) for x in self._inputs)

    def attribute(self, target: str) -> torch.Tensor | None:
        """A parameter or buffer of the compiled module (``ParamAOTInput``/``BufferAOTInput``)."""
        module = self._module()
        try:
            return None if module is None else module.get_parameter(target)
        except AttributeError:
            try:
                return module.get_buffer(target)  # type: ignore[union-attr]
            except AttributeError:
                return None


JointGraphHandler = Callable[[JointGraph], "tuple[fx.GraphModule, fx.GraphModule]"]


class _Compiling(threading.local):
    """The real inputs of the graph a backend is compiling on this thread (AOTAutograd hands the
    partition function fake tensors only)."""

    inputs: StepInputs | None = None
    identity: str | None = None  # Inductor's cache identity of the compile (inductor_compile)
    partitioned: bool = False


def _recording_inputs(compiling: _Compiling, compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        previous, compiling.inputs = compiling.inputs, StepInputs(gm, example_inputs)
        try:
            return compile_fn(gm, example_inputs)
        finally:
            compiling.inputs = previous

    return backend


def _partition_fn(handler: JointGraphHandler, compiling: _Compiling,
                  compiler: str = "eager") -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    """Adapt a handler to AOTAutograd's ``partition_fn(joint, joint_inputs, *, num_fwd_outputs, ...)``."""

    def partition(
        joint_module: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        kwargs.pop("compiler", None)
        compiling.partitioned = True
        return handler(JointGraph(joint_module, num_fwd_outputs, dict(kwargs), compiling.inputs, compiler,
                                  compiling.identity))

    return partition


def _inductor_backend(handler: JointGraphHandler, plans: CompiledPlans | None) -> Callable[[fx.GraphModule, list[Any]], Any]:
    if not has_custom_partitioner():
        raise CaptureError(
            f"inner='inductor' needs torch._inductor.config.custom_partitioner_fn, which torch "
            f"{torch.__version__} lacks; use inner='eager' or a newer torch"
        )
    compiling = _Compiling()
    partition = _partition_fn(handler, compiling, "inductor")

    def compile_(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_with_inductor(gm, example_inputs, partition, compiling, plans)

    return _recording_inputs(compiling, compile_)


def _chunking_losses(config: ChunkLoss | None, compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Chunk the language-model loss of each Dynamo graph (``loss_chunking``) before AOTAutograd
    traces it; with no config, ``compile_fn`` itself."""
    if config is None:
        return compile_fn

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        # A copy: the graph Dynamo gave may be compiled again, whole or chunked otherwise (loss_choice).
        chunked = copied(gm)
        chunk_losses(chunked, config)
        return compile_fn(chunked, example_inputs)

    return backend


def make_dynamo_backend(handler: JointGraphHandler, inner: str = "eager",
                        chunk_loss: ChunkLoss | None = None, plans: CompiledPlans | None = None) -> Callable[..., Any]:
    """A ``torch.compile`` backend that partitions every joint graph with ``handler``; with
    ``chunk_loss``, each graph's language-model loss is chunked first (``loss_chunking``).
    ``plans``: where torch's caches may answer a compile (``cached_compile``)."""
    if inner == "inductor":
        return _chunking_losses(chunk_loss, _inductor_backend(handler, plans))
    if inner != "eager":
        raise ValueError(f"inner compiler must be one of {INNER_COMPILERS}, got {inner!r}")
    compiling = _Compiling()
    partition = _partition_fn(handler, compiling)

    def compile_(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_eager(gm, example_inputs, partition, compiling, plans)

    return _chunking_losses(chunk_loss, _recording_inputs(compiling, compile_))


def capture(model: torch.nn.Module, example_inputs: Sequence[Any],
            example_kwargs: Mapping[str, Any] | None = None, chunk_loss: ChunkLoss | None = None) -> list[JointGraph]:
    """Trace one training forward of ``model`` and return its joint graphs, one per piece.

    Runs ``model(*example_inputs, **example_kwargs)`` once (needed by dynamo), with the RNG state and the
    module's buffers restored afterwards, and partitions nothing away: the graphs come back
    whole, for inspection, annotation and planning without training. ``chunk_loss`` chunks
    each graph's language-model loss first, as the training backend would.
    """
    from torch._functorch.partitioners import default_partition

    graphs: list[JointGraph] = []

    def record(joint: JointGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        graphs.append(joint)  # default_partition builds new graphs and leaves this one's nodes as they are
        return default_partition(joint.module, None, num_fwd_outputs=joint.num_fwd_outputs, **joint.partition_kwargs)

    compiled = torch.compile(model, backend=make_dynamo_backend(record, chunk_loss=chunk_loss), dynamic=False)
    try:
        with untouched(model, (example_inputs, example_kwargs)), torch.enable_grad(), \
                capture_config(), older_objects_frozen():
            compiled(*example_inputs, **(example_kwargs or {}))
    except torch._dynamo.exc.TorchDynamoException as error:
        raise capture_failure(error) from error
    if not graphs:
        raise CaptureError("nothing to plan: no parameter or input requires grad, so there is no backward graph")
    return graphs
