"""Stage 2: annotate the joint graph and distil the torch-free planning ``Problem``.

For every node: forward or backward, the storage it lives in (views and aliases share their
base's storage and are charged once), its FLOPs (``torch.utils.flop_counter``'s formulas), an
estimated recompute time (roofline, see ``costs``), and flags: random, mutation, view, matmul,
attention core, available (parameters, buffers, inputs). The record is stored on each node as
``node.meta["remat"]``; the networkx graph is a view derived from it on demand.

Forward, here, means "does not depend on a tangent": such a node could run in the forward
pass and be saved, or run again in backward. Everything that reads a tangent is backward.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import networkx as nx
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from remat_pass.solvers.problem import Problem, Value
from remat_pass.solvers.tags import Tag

from .attention_core import tag_attention_core
from .attribution import fill_module_attribution, module_path
from .batch_norm import drop_running_stats_from_backward, is_new_running_stat, is_training_batch_norm, running_stat_args
from ..capture.capture import JointGraph
from .eager_parity import checkpoint_tags, derived_in_backward, drop_identity_copies
from .collectives import collective_seconds, is_collective
from ..compat import concrete_int as _concrete  # symbolic sizes: torch internals live in compat
from ..compat import is_symbolic as _is_symbolic
from .dropout_replay import dropout_replay_sources, order_dropout_masks
from .costs import AUTO, CostModel, DeviceProfile, parse_costs, pricing_profiles
from .flops import node_flops as _flops
from .fused_costs import fused_recompute_prices, unallocated_in_backward
from ..capture.loss_chunking import chunked_regions, describe as describe_chunked
from .backward_steps import backward_steps
from .node_memory import bytes_moved as _bytes_moved
from .node_memory import dtype_of as _dtype_of
from .node_memory import same_storage as _same_storage
from .node_memory import tensor_bytes as _tensor_bytes
from .op_timing import measured_seconds
from .scratch import kernel_scratch

logger = logging.getLogger(__name__)

META_KEY = "remat"
FORWARD, BACKWARD = "forward", "backward"
NO_STORAGE = 0  # storage index shared by values that hold no bytes of their own (tuples, symbols)

_MATMUL_OPS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution", "_convolution"}


@dataclass(frozen=True)
class NodeInfo:
    """What annotate learned about one joint-graph node (``node.meta["remat"]``)."""

    phase: str
    value_id: int | None
    storage_bytes: int
    flops: int
    recompute_seconds: float
    tags: frozenset[str]
    module: str
    scratch_bytes: int = 0  # the kernel's working memory while it runs (remat_pass.annotate.scratch)
    unallocated: bool = False  # a backward tensor Inductor computes inside its readers' kernels (fused_costs)


@dataclass(frozen=True)
class AnnotatedGraph:
    """The planning problem plus the map back from value ids to joint-graph nodes."""

    joint: JointGraph
    problem: Problem
    nodes: tuple[fx.Node, ...]

    def to_networkx(self) -> nx.DiGraph:
        """The whole joint graph as a DiGraph: node attributes from ``node.meta["remat"]``."""
        graph = nx.DiGraph()
        for node in self.joint.module.graph.nodes:
            info: NodeInfo | None = node.meta.get(META_KEY)
            attrs = vars(info).copy() if info else {"phase": node.op}
            graph.add_node(node.name, op=str(node.target), **attrs)
            for source in node.all_input_nodes:
                graph.add_edge(source.name, node.name)
        return graph


def annotate(joint: JointGraph, device: str | DeviceProfile = AUTO, *, free_inputs: bool = True,
             costs: str = CostModel.ROOFLINE, scratch_store: Path | None = None,
             fused_prices: bool = True, fused_memory: bool = True) -> AnnotatedGraph:
    """Annotate every node of ``joint`` in place (``meta["remat"]``) and build the Problem.

    Parameters and buffers are always available at no cost. ``free_inputs`` says the same of
    the graph's other inputs: true for a whole training step (its inputs are the user's, alive
    anyway); false for a piece after a graph break, whose inputs are activations of the piece
    before — saving one of them for backward keeps it alive, so it is charged like any kept
    value (it can be kept, never recomputed: its producer is in another graph). ``costs`` prices
    ops (``costs.CostModel``: the roofline, FLOPs alone, or times measured by ``op_timing``).
    ``scratch_store``: a directory where kernel scratch measurements persist (``scratch.kernel_scratch``).
    ``fused_prices``: for a graph Inductor compiles, price a pointwise recompute fused into its
    reader (``fused_costs``); False prices every op as a kernel of its own, as for eager.
    ``fused_memory``: for a graph Inductor compiles, leave the backward tensors Inductor computes
    inside their readers' kernels unallocated (``fused_costs.unallocated_in_backward``); False
    counts every backward tensor, as for eager.
    """
    graph = joint.module.graph
    where, profile = pricing_profiles(device, costs, tensors_on=_step_device(graph))
    order_dropout_masks(graph)
    drop_identity_copies(graph)
    charged = set() if free_inputs else _activation_inputs(joint)
    backward_nodes = tangent_dependent(graph)
    backward_nodes |= derived_in_backward(graph, backward_nodes, joint.num_fwd_outputs)
    drop_running_stats_from_backward(backward_nodes)  # see remat_pass.annotate.batch_norm
    measured = measured_seconds(graph, joint.step_inputs, backward_nodes) if parse_costs(costs) == "measure" else {}
    fake_step = joint.step_inputs is not None and joint.step_inputs.are_fake()
    scratch = kernel_scratch(graph, _graph_outputs(graph)[joint.num_fwd_outputs :], estimate=fake_step,
                             store=scratch_store)
    storages = _StorageTable()
    values: list[Value] = []
    value_nodes: list[fx.Node] = []
    ids: dict[fx.Node, int] = {}

    for node in graph.nodes:
        if node.op == "output" or node in backward_nodes:
            continue
        value = replace(_make_value(node, len(values), ids, storages, profile, charged=node in charged),
                        scratch_bytes=scratch.get(node, 0))
        value = replace(value, recompute_seconds=measured[node]) if node in measured else value
        ids[node] = value.id
        values.append(value)
        value_nodes.append(node)

    if fused_prices and joint.compiler == "inductor":  # the program that runs fuses pointwise recomputes
        values = list(fused_recompute_prices(values, value_nodes, profile))
    _pin_readers_of_mutated_inputs(graph, values, value_nodes)
    fill_module_attribution(values, value_nodes)
    tag_attention_core(values, ignored_storages={NO_STORAGE})
    backward_reads = _backward_reads(graph, joint.num_fwd_outputs, backward_nodes, ids)
    outputs = _graph_outputs(graph)
    gradients = outputs[joint.num_fwd_outputs :]
    unallocated = (unallocated_in_backward([n for n in graph.nodes if n in backward_nodes], gradients)
                   if fused_memory and joint.compiler == "inductor" else frozenset())
    problem = Problem(
        values=tuple(values),
        storage_bytes=tuple(storages.sizes),
        backward_reads=frozenset(backward_reads),
        device=where.name,
        forward_outputs=frozenset(ids[n] for n in outputs[: joint.num_fwd_outputs] if n in ids),
        backward_steps=backward_steps(graph, backward_nodes, ids, gradients, profile, scratch, unallocated),
        host_bytes_per_second=where.host_link_bytes_per_second,
        costs="measure" if measured else "flops" if profile.name == "flops" else "roofline",
        notes=tuple(describe_chunked(region) for region in chunked_regions(graph)),
    )
    _store_meta(graph, ids, problem, scratch, unallocated)
    logger.debug(
        "annotated %d forward values, %d backward reads, keep-all %d bytes",
        len(values), len(backward_reads), problem.keep_all_bytes(),
    )
    return AnnotatedGraph(joint=joint, problem=problem, nodes=tuple(value_nodes))


# --- classification -------------------------------------------------------------------------


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and ("tangents" in node.name or "bwd_seed" in node.name)


def tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that read a tangent, directly or not: the backward pass proper."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if _is_tangent(node) or any(source in backward for source in node.all_input_nodes):
            backward.add(node)
    return backward


def _backward_reads(
    graph: fx.Graph, num_fwd_outputs: int, backward_nodes: set[fx.Node], ids: dict[fx.Node, int]
) -> set[int]:
    reads: set[int] = set()
    for node in backward_nodes:
        reads.update(ids[source] for source in node.all_input_nodes if source in ids)
    output = next(iter(graph.find_nodes(op="output")))
    gradients, _ = tree_flatten(output.args[0][num_fwd_outputs:])
    reads.update(ids[g] for g in gradients if isinstance(g, fx.Node) and g in ids)
    return reads


def _graph_outputs(graph: fx.Graph) -> list[fx.Node | None]:
    output = next(iter(graph.find_nodes(op="output")))
    return [a if isinstance(a, fx.Node) else None for a in output.args[0]]


# --- one value --------------------------------------------------------------------------------


class _StorageTable:
    """Assigns storage indices; a storage touched by an available value costs 0 bytes."""

    def __init__(self) -> None:
        self.sizes: list[int] = [0]  # NO_STORAGE
        self._index: dict[StorageWeakRef, int] = {}

    def index_of(self, tensor: torch.Tensor, available: bool, nbytes: int | None = None) -> int:
        key = StorageWeakRef(tensor.untyped_storage())
        if key not in self._index:
            self._index[key] = len(self.sizes)
            size = _concrete(tensor.untyped_storage().nbytes()) if nbytes is None else nbytes
            self.sizes.append(0 if available else size)
        index = self._index[key]
        if available:
            self.sizes[index] = 0
        return index


def _activation_inputs(joint: JointGraph) -> set[fx.Node]:
    """Tensor inputs that are neither parameters nor buffers (AOTAutograd's static inputs).

    AOTAutograd's ``static_lifetime_input_indices`` are positions among the *outer*
    arguments. Without tensor subclasses those are the graph's placeholders one to one; a
    DTensor argument (tensor parallel, FSDP2) is flattened into several placeholders (its
    local tensor, its mesh), so positions among placeholders would charge a weight shard as
    an activation. Each placeholder's descriptor (``meta["desc"]``) names the outer argument
    it came from; decide from that. Graphs without descriptors (older torch) use positions.
    """
    static = set(joint.partition_kwargs.get("static_lifetime_input_indices") or ())
    primals = [n for n in joint.module.graph.find_nodes(op="placeholder") if not _is_tangent(n)]
    tensors = [n for n in primals if isinstance(n.meta.get("val"), torch.Tensor)]
    if any(n.meta.get("desc") is None for n in tensors):
        return {n for i, n in enumerate(primals) if i not in static and n in tensors}
    return {n for n in tensors if _outer_argument_is_activation(n.meta["desc"], static)}


def _outer_argument_is_activation(desc: Any, static: set[int]) -> bool:
    """Follow a placeholder's descriptor to the argument the user passed, and judge that."""
    while hasattr(desc, "base") or hasattr(desc, "base_of"):  # subclass attribute, view/synthetic base
        desc = getattr(desc, "base", None) or getattr(desc, "base_of")
    kind = type(desc).__name__
    if kind in ("ParamAOTInput", "BufferAOTInput"):
        return False
    if kind == "PlainAOTInput":
        return desc.idx not in static
    return False  # RNG seeds and offsets, effect tokens: not activations


def _step_device(graph: fx.Graph) -> torch.device | None:
    """The device of the step's first tensor input (what ``device="auto"`` prices for)."""
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _make_value(
    node: fx.Node,
    value_id: int,
    ids: dict[fx.Node, int],
    storages: _StorageTable,
    profile: DeviceProfile,
    charged: bool = False,
) -> Value:
    val = node.meta.get("val")
    available = (node.op in ("placeholder", "get_attr") and not charged) or _is_symbolic(val)
    tags = set(_op_tags(node)) | checkpoint_tags(node)
    if charged:
        tags.add(Tag.PIECE_INPUT)
    is_tensor = isinstance(val, torch.Tensor)
    if is_tensor:
        aliases_input = any(
            isinstance(source.meta.get("val"), torch.Tensor) and _same_storage(source.meta["val"], val)
            for source in node.all_input_nodes
        )
        if aliases_input and node.op == "call_function":
            tags.add(Tag.VIEW)
        storage = storages.index_of(val, available, _real_norm_stat_bytes(node, val))
    else:
        storage = NO_STORAGE
        if node.op == "call_function" and _aliases_inputs(node, val):
            tags.add(Tag.VIEW)  # split/unbind/chunk: a tuple of views
    flops = _flops(node) if node.op == "call_function" else 0
    seconds = 0.0
    if node.op == "call_function" and Tag.VIEW not in tags and node.target is not operator.getitem:
        seconds = profile.op_seconds(flops, _bytes_moved(node), _dtype_of(val))
    if Tag.COLLECTIVE in tags:  # what running it again would cost: communication, not compute
        seconds = collective_seconds(node, max(_tensor_bytes(val), _bytes_moved(node) - _tensor_bytes(val)), profile.name)
    recomputable = (not available and not tags & {Tag.RANDOM, Tag.MUTATION, Tag.COLLECTIVE}
                    and node.op == "call_function" and not is_new_running_stat(node))
    sources = [s for s in node.all_input_nodes if s not in running_stat_args(node)]
    replay = dropout_replay_sources(node)
    if replay is not None:
        # Rebuilt as input * mask * scale in forward and again in backward: twice a pointwise op.
        sources = list(replay)
        tags.add(Tag.DROPOUT_REPLAY)
        moved = sum(_tensor_bytes(s.meta.get("val")) for s in sources) + _tensor_bytes(val)
        seconds = 2 * profile.op_seconds(0, moved, _dtype_of(val))
    return Value(
        id=value_id,
        name=node.name,
        inputs=tuple(sorted({ids[s] for s in sources if s in ids})),
        storage=storage,
        recompute_seconds=seconds,
        flops=flops,
        recomputable=recomputable,
        keepable=is_tensor and not available,
        available=available,
        module=module_path(node),
        op=_op_name(node),
        tags=frozenset(tags),
    )


# Norms whose CPU kernels return their saved statistics (outputs 1 and 2) in float32 for a
# bf16/fp16 input with float32 parameters; the arguments that hold those parameters.
_MIXED_STAT_NORMS = {
    "native_batch_norm": slice(1, 5), "_native_batch_norm_legit": slice(1, 5),
    "_native_batch_norm_legit_functional": slice(1, 5), "_native_batch_norm_legit_no_training": slice(1, 5),
    "native_layer_norm": slice(2, 4), "native_group_norm": slice(1, 3),
}


def _real_norm_stat_bytes(node: fx.Node, val: torch.Tensor) -> int | None:
    """The true size of a CPU norm's saved mean or inverse std, where the fake tensor is wrong.

    With a bf16/fp16 input and float32 weight, bias or running statistics (the usual case under
    autocast), aten's CPU batch/layer/group norm kernels return these two in float32, while the
    meta functions (which fake tensors use) give the input's dtype. Without this, the plan
    under-counts them and the measured saved bytes exceed the prediction. None: trust the fake.
    """
    if node.target is not operator.getitem or node.args[1] not in (1, 2) or val.device.type != "cpu":
        return None
    norm = node.args[0]
    target = getattr(norm, "target", None)
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket.__name__ not in _MIXED_STAT_NORMS:
        return None
    source = norm.args[0].meta.get("val") if isinstance(norm.args[0], fx.Node) else None
    param_args = norm.args[_MIXED_STAT_NORMS[target.overloadpacket.__name__]]
    params = [a.meta.get("val") for a in param_args if isinstance(a, fx.Node)]
    mixed = (
        isinstance(source, torch.Tensor)
        and source.dtype in (torch.bfloat16, torch.float16)
        and any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)
    )
    if not mixed or val.dtype == torch.float32:
        return None
    return _concrete(val.numel()) * torch.finfo(torch.float32).bits // 8


def _op_tags(node: fx.Node) -> Iterable[str]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return
    if torch.Tag.nondeterministic_seeded in target.tags and _argument(node, "dropout_p", 1.0) != 0:
        # Attention kernels carry the tag for their optional dropout; with p = 0 they draw nothing.
        yield Tag.RANDOM
    functional = target.overloadpacket.__name__.endswith("_functional") and not is_training_batch_norm(node)
    if target._schema.is_mutable or _is_impure(node) or functional:
        # A functionalized mutating op reads state the step overwrites after the forward:
        # recomputed in backward it would read the buffers after that update, and autograd
        # rejects a saved tensor modified in place. Never recomputed. Training BatchNorm is
        # recomputed without its running statistics (remat_pass.annotate.batch_norm).
        yield Tag.MUTATION
    if is_collective(node):  # see remat_pass.annotate.collectives: every rank must run it, exactly once
        yield Tag.COLLECTIVE
    if target.overloadpacket.__name__ in _MATMUL_OPS:
        yield Tag.MATMUL
    if "scaled_dot_product" in target.overloadpacket.__name__:
        yield Tag.MATMUL
        yield Tag.ATTENTION_CORE


def _argument(node: fx.Node, name: str, missing: Any) -> Any:
    """The value of the op's argument called ``name`` (positional, keyword or default)."""
    schema = node.target._schema  # type: ignore[union-attr]
    for index, argument in enumerate(schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            if name in node.kwargs:
                return node.kwargs[name]
            return argument.default_value if argument.has_default_value() else missing
    return missing


def _is_impure(node: fx.Node) -> bool:
    try:
        return node.is_impure(impure_random=False)  # type: ignore[call-arg]
    except TypeError:  # older torch: no impure_random argument
        return node.is_impure()


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.overloadpacket.__name__}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _aliases_inputs(node: fx.Node, val: Any) -> bool:
    outputs = [t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)]
    inputs = [s.meta["val"] for s in node.all_input_nodes if isinstance(s.meta.get("val"), torch.Tensor)]
    return bool(outputs) and all(any(_same_storage(o, i) for i in inputs) for o in outputs)


def _mutated_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Placeholders whose tensors the AOTAutograd runtime overwrites after forward.

    A forward that mutates an input (``x.mul_(2)``, a BatchNorm's running statistics) is
    functionalized: the graph returns the new value and the runtime copies it into the input
    before backward runs. AOTAutograd describes these outputs in the output node's "desc"
    (older torch has no descriptors: then nothing is found).
    """
    output = next(iter(graph.find_nodes(op="output")))
    mutated = [
        getattr(desc, "mutated_input", None)
        for desc in output.meta.get("desc") or ()
        if type(desc).__name__ == "InputMutationAOTOutput"
    ]
    return {p for p in graph.find_nodes(op="placeholder") if p.meta.get("desc") is not None and p.meta["desc"] in mutated}


def _pin_readers_of_mutated_inputs(graph: fx.Graph, values: list[Value], nodes: list[fx.Node]) -> None:
    """Values read from a mutated input are never recomputed: in backward the input holds its
    new data (wrong results), and autograd rejects a saved tensor modified in place."""
    mutated = _mutated_inputs(graph)
    for index, node in enumerate(nodes):
        if values[index].recomputable and mutated.intersection(set(node.all_input_nodes) - running_stat_args(node)):
            values[index] = replace(values[index], recomputable=False)


def _store_meta(graph: fx.Graph, ids: dict[fx.Node, int], problem: Problem, scratch: dict[fx.Node, int],
                unallocated: frozenset[fx.Node]) -> None:
    for node in graph.nodes:
        if node.op == "output":
            continue
        value_id = ids.get(node)
        if value_id is None:
            node.meta[META_KEY] = NodeInfo(BACKWARD, None, 0, _flops(node), 0.0, frozenset(), module_path(node),
                                           scratch.get(node, 0), node in unallocated)
            continue
        value = problem.values[value_id]
        node.meta[META_KEY] = NodeInfo(FORWARD, value_id, problem.storage_bytes[value.storage], value.flops,
                                       value.recompute_seconds, value.tags, value.module, value.scratch_bytes)

