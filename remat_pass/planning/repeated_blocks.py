"""Trace a deep stack of identical blocks once per block, not once per layer, for planning.

Capture (Dynamo, AOTAutograd) and annotate cost about 0.8 s per Llama-2-70B-shaped layer at 8
layers on this machine, and more per layer deeper (AOTAutograd's joint trace grows faster than
linearly): the 80-layer step took 218 s and 3.3 GiB to trace (benchmarks/SCALING.md). Where a model
holds an ``nn.ModuleList`` of identical blocks (``repeated_stack``: one class, the same
parameter and buffer shapes, the same attributes but for the layer index, no hooks), the step
is traced with the first 3 and the first 4 blocks only, and the 4-block Problem is stamped out to
the full depth (``block_stamp.stamp_problem``). The 3-block one is the check: stamped to 4 blocks
it must equal the traced 4-block Problem (names aside), else the blocks are not what they seem
(Gemma's alternating sliding-window layers, anything that depends on the layer index inside the
first four) and the whole model is traced, with the reason logged. Everything else falls back
too: a stack of 6 blocks or fewer (nothing to gain), graph breaks (several pieces), measured
costs (they need the real graph).

For ``plan`` / ``explain``-style planning, which only needs the Problem: a stamped ``TracedStep``
has no annotated graphs to rewrite (``optimize`` must run the real, full graph and traces it whole).
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from torch import fx, nn

from ..annotate.annotate import BACKWARD, META_KEY
from ..annotate.costs import CostModel, DeviceProfile, parse_costs
from ..capture.loss_chunking import ChunkLoss
from ..errors import CaptureError
from .block_stamp import BlockLabels, StampRefused, stamp_problem, without_names
from .tracing import LossFn, TracedStep, trace_step

logger = logging.getLogger(__name__)

TRACED = 4  # blocks traced (and 3 for the check): a first, two middle, a last
MIN_DEPTH = 7  # below this, tracing the whole stack costs about as much
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@dataclass(frozen=True)
class Stack:
    """A ``nn.ModuleList`` of identical blocks at ``path`` in the model."""

    path: str
    depth: int


def repeated_stack(model: nn.Module) -> Stack | None:
    """The deepest ``ModuleList`` of identical blocks in ``model`` (None, logged, when there is none)."""
    found = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= MIN_DEPTH and (found is None or len(module) > found.depth):
            why = _not_identical(list(module))
            if why:
                logger.info("%s: not stamped, traced whole (%s)", path, why)
                continue
            found = Stack(path, len(module))
    return found


def _not_identical(blocks: list[nn.Module]) -> str:
    first = _signature(blocks[0])
    for index, block in enumerate(blocks[1:], 1):
        if any(getattr(m, hook, None) for m in block.modules() for hook in _HOOKS):
            return f"block {index} has hooks"
        if _signature(block) != first:
            return f"block {index} differs from block 0 (class, parameter or buffer shapes, or attributes)"
    if any(getattr(m, hook, None) for m in blocks[0].modules() for hook in _HOOKS):
        return "block 0 has hooks"
    return ""


def _signature(block: nn.Module) -> list[Any]:
    """What two blocks must share: classes, parameters' and buffers' shapes, dtypes and
    requires_grad, and every plain attribute (the layer index aside) by equality."""
    parts: list[Any] = []
    for name, module in block.named_modules():
        attributes = sorted((k, _plain(v)) for k, v in vars(module).items()
                            if not k.startswith("_") and k not in _INDEX_ATTRIBUTES)
        parts.append((name, type(module), attributes))
    parts += [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in block.named_parameters()]
    parts += [(n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()]
    return parts


def _plain(value: Any) -> Any:
    """Attributes compared by value where they are plain data, else by identity (a shared config)."""
    return value if isinstance(value, (bool, int, float, str, type(None), tuple)) else id(value)


@contextlib.contextmanager
def _truncated(model: nn.Module, stack: Stack, blocks: int) -> Iterator[None]:
    """``model`` with only the first ``blocks`` blocks of its stack, put back afterwards."""
    parent_path, _, name = stack.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    original = getattr(parent, name)
    setattr(parent, name, nn.ModuleList(list(original)[:blocks]))
    try:
        yield
    finally:
        setattr(parent, name, original)


def trace_repeated(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    device: str | DeviceProfile = "auto",
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    costs: str = CostModel.ROOFLINE,
    chunk_loss: ChunkLoss | None = None,
) -> TracedStep:
    """``tracing.trace_step``'s Problem, traced once per repeated block where the model allows
    (see the module); otherwise ``trace_step`` itself. The result has no annotated graphs when stamped."""
    def whole() -> TracedStep:
        return trace_step(model, example_inputs, loss_fn, device, example_kwargs=example_kwargs, costs=costs,
                          chunk_loss=chunk_loss)

    stack = repeated_stack(model)
    if stack is None or parse_costs(costs) == CostModel.MEASURE:
        return whole()
    try:
        shallow = {}
        for blocks in (TRACED - 1, TRACED):  # the model's list swapped for a shorter one, put back after
            with _truncated(model, stack, blocks):
                try:
                    shallow[blocks] = trace_step(model, example_inputs, loss_fn, device,
                                                 example_kwargs=example_kwargs, costs=costs, chunk_loss=chunk_loss)
                except CaptureError as error:  # the whole model says it best, if it fails too
                    raise StampRefused(f"{blocks} blocks could not be traced: {error}") from error
        path = stack.path  # paths in the Problem are the model's (trace_step strips its loss wrapper)
        labels = {k: block_labels(t, path, k) for k, t in shallow.items()}
        check = stamp_problem(shallow[TRACED - 1].problem, labels[TRACED - 1], TRACED - 1, TRACED, path)
        if without_names(check) != without_names(shallow[TRACED].problem):
            raise StampRefused(f"the first {TRACED - 1} blocks stamped to {TRACED} differ from {TRACED} traced")
        problem = stamp_problem(shallow[TRACED].problem, labels[TRACED], TRACED, stack.depth, path)
    except StampRefused as why:
        logger.info("%s: not stamped, traced whole (%s)", stack.path, why)
        return whole()
    per_block = shallow[TRACED].step_flops - shallow[TRACED - 1].step_flops
    logger.info("%s: %d blocks stamped from %d traced", stack.path, stack.depth, TRACED)
    return TracedStep(problem, shallow[TRACED].step_flops + (stack.depth - TRACED) * per_block,
                      chunked=shallow[TRACED].chunked)


def block_labels(traced: TracedStep, stack_path: str, blocks: int) -> BlockLabels:
    """Which block each value and backward step of a one-piece ``traced`` step belongs to."""
    if traced.pieces != 1:
        raise StampRefused(f"the step has {traced.pieces} graphs (graph breaks)")
    (piece,) = traced.annotated
    index = re.compile(r"(?:^|\.)" + re.escape(stack_path) + r"\.(\d+)(?:\.|$)")

    def block(path: str) -> int | None:
        found = index.search(path or "")
        return int(found.group(1)) if found and int(found.group(1)) < blocks else None

    values = _fill_inside_blocks([block(v.module) for v in traced.problem.values])
    users: list[set[int | None]] = [set() for _ in values]
    for value in traced.problem.values:
        for source in value.inputs:
            users[source].add(values[value.id])
    for value in traced.problem.values:  # a parameter belongs to the block whose values read it
        if value.available and values[value.id] is None and len(users[value.id]) == 1:
            values[value.id] = next(iter(users[value.id]))
    steps = _fill_inside_blocks([block(n.meta[META_KEY].module) for n in _backward_calls(piece.joint.module.graph)],
                                between_blocks=True)
    return BlockLabels(tuple(values), tuple(steps))


def _fill_inside_blocks(labels: list[int | None], between_blocks: bool = False) -> list[int | None]:
    """Values between two of one block's values belong to it: code a block's forward calls outside
    any submodule (Llama's ``apply_rotary_pos_emb``) records a function, not a module, as its path.
    ``between_blocks``: so do backward steps between two blocks' runs, to the later one (the
    residual stream's gradient sum that starts a block's backward has no module)."""
    last: int | None = None
    for index, label in enumerate(labels):
        if label is None:
            continue
        if last is not None and (labels[last] == label or between_blocks):
            labels[last + 1:index] = [label] * (index - last - 1)
        last = index
    return labels


def _backward_calls(graph: fx.Graph) -> list[fx.Node]:
    """The backward ops, one per ``BackwardStep`` (``annotate.backward_steps``)."""
    return [n for n in graph.nodes if n.op == "call_function" and META_KEY in n.meta
            and n.meta[META_KEY].phase == BACKWARD]


__all__ = ["Stack", "block_labels", "repeated_stack", "trace_repeated"]
