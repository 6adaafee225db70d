"""Trace one training step into one torch-free ``Problem``: the first half of the pipeline.

``trace_step`` captures the step (model, and the loss when given) with Dynamo/AOTAutograd,
annotates every joint graph and merges the pieces between graph breaks into one problem
(``merge_problems``), since their saved activations are alive together. ``explain``, ``sweep``
and ``plan`` start here; the ``torch.compile`` backend does not (it plans each piece on its own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from remat_pass.solvers.problem import Problem

from ..annotate.annotate import META_KEY, AnnotatedGraph, annotate
from ..capture.capture import capture
from ..capture.loss_chunking import ChunkedRegion, ChunkLoss, chunked_regions
from ..annotate.costs import CostModel, DeviceProfile
from ..capture.inputs import call_inputs
from ..compat import forget_compiled
from .progress import phase

LossFn = Callable[..., torch.Tensor]
_WRAPPED = "model"  # attribute under which _WithLoss holds the user's model


@dataclass(frozen=True)
class TracedStep:
    """One traced training step: the planning problem and the step's total FLOPs.

    ``step_flops`` adds the FLOP counts annotate put on every joint-graph node, forward and
    backward (matmuls and attention; pointwise ops count 0). ``pieces`` is the number of graphs
    between graph breaks; several are planned as one problem, since their saved activations are
    alive together (the ``torch.compile`` backend, by contrast, gives each piece the budget).
    ``annotated`` holds each piece's annotated joint graph (to rewrite or simulate a plan; with one
    piece, the problem's value ids are that graph's).
    """

    problem: Problem
    step_flops: int
    pieces: int = 1
    annotated: tuple[AnnotatedGraph, ...] = field(default=(), repr=False, compare=False)
    # The losses computed in chunks (capture.loss_chunking), kept apart from the graphs, which a
    # stamped step (planning.repeated_blocks) does not have.
    chunked: tuple[ChunkedRegion, ...] = ()

    @property
    def forward_seconds(self) -> float:
        """The cost model's time for the forward: every value the step computes, once."""
        return self.problem.forward_seconds()


class _WithLoss(nn.Module):
    """model + loss in one forward, so the loss's saved tensors are planned too."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        self.loss_fn = loss_fn

    def forward(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(getattr(self, _WRAPPED)(*inputs, **kwargs), *inputs, **kwargs)


def as_inputs(example_inputs: Any) -> tuple[Any, ...]:
    """A tuple of inputs: a tuple or list as given, anything else (one tensor) as a 1-tuple."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def trace_step(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    device: str | DeviceProfile = "auto",
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    costs: str = CostModel.ROOFLINE,
    chunk_loss: ChunkLoss | None = None,
) -> TracedStep:
    """Capture and annotate one training step of ``model``; nothing is trained or modified.

    Inputs as ``optimize`` takes them (``inputs.call_inputs``): a tuple of positional inputs,
    one tensor, or a dict of keyword inputs, plus ``example_kwargs``. ``loss_fn(output, *args,
    **kwargs)``, when given, becomes part of the traced step; its values are planned too and
    belong to no module (``""``). ``costs`` prices recompute as for ``optimize`` ("measure" needs
    real tensors; traced from meta ones, the roofline prices the step and a warning says so).
    ``chunk_loss`` chunks the step's language-model loss as training would (``capture.loss_chunking``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    call = call_inputs(example_inputs, example_kwargs)
    target = model if loss_fn is None else _WithLoss(model, loss_fn)
    with phase("tracing the step", "traced the step"):
        try:
            annotated = [annotate(joint, device, costs=costs)
                         for joint in capture(target, call.args, call.kwargs, chunk_loss=chunk_loss)]
        finally:
            if loss_fn is not None:  # each trace compiles a new wrapper: never pile up to the recompile limit
                forget_compiled(_WithLoss.forward)
    step_flops = sum(
        node.meta[META_KEY].flops for a in annotated for node in a.joint.module.graph.nodes if META_KEY in node.meta
    )
    problem = merge_problems([a.problem for a in annotated])
    if loss_fn is not None:
        problem = _strip_wrapper(problem)
    chunked = tuple(region for a in annotated for region in chunked_regions(a.joint.module.graph))
    return TracedStep(problem=problem, step_flops=step_flops, pieces=len(annotated), annotated=tuple(annotated),
                      chunked=chunked)


def merge_problems(problems: Sequence[Problem]) -> Problem:
    """Several independent graphs as one problem: ids and storages renumbered, names prefixed
    ``g<piece>.``; backward runs the pieces in reverse order. One problem is returned as is."""
    if len(problems) == 1:
        return problems[0]
    values, storage_bytes, reads, outputs, steps = [], [], set(), set(), []
    for piece, problem in enumerate(problems):
        first_id, first_storage = len(values), len(storage_bytes)
        for value in problem.values:
            values.append(dataclasses.replace(
                value, id=value.id + first_id, name=f"g{piece}.{value.name}",
                inputs=tuple(i + first_id for i in value.inputs), storage=value.storage + first_storage))
        storage_bytes.extend(problem.storage_bytes)
        reads.update(i + first_id for i in problem.backward_reads)
        outputs.update(i + first_id for i in problem.forward_outputs)
        # Backward runs the pieces in reverse order.
        steps[:0] = [dataclasses.replace(step, reads=tuple(i + first_id for i in step.reads))
                     for step in problem.backward_steps]
    return Problem(tuple(values), tuple(storage_bytes), frozenset(reads), device=problems[0].device,
                   forward_outputs=frozenset(outputs), backward_steps=tuple(steps), costs=problems[0].costs,
                   notes=tuple(note for problem in problems for note in problem.notes))


def _strip_wrapper(problem: Problem) -> Problem:
    """Module paths as the user's model names them, without _WithLoss's attribute."""

    def strip(path: str) -> str:
        return "" if path == _WRAPPED else path.removeprefix(_WRAPPED + ".")

    values = tuple(dataclasses.replace(v, module=strip(v.module)) for v in problem.values)
    return dataclasses.replace(problem, values=values)


__all__ = ["LossFn", "TracedStep", "as_inputs", "merge_problems", "trace_step"]
