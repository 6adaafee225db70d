"""Stage 4: rewrite the joint graph into a forward graph and a recomputing backward graph.

The forward graph returns the user outputs plus the kept tensors; the backward graph takes
the kept tensors and the tangents, recomputes each chosen value *just before its first use*
and lets it go after its last use (FX code drops a value after its last reader), so memory
really falls instead of every recomputation piling up at the start of backward.

Extraction itself is AOTAutograd's own ``_extract_fwd_bwd_modules``: it knows the calling
convention the AOTAutograd runtime expects (saved symbols first, version-counter checks,
seeds), which changes between torch releases; we only choose what is saved and reorder.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from remat_pass.solvers.problem import Plan

from . import offload
from .kept_views import ViewsMadeAgain, views_made_again
from ..annotate.annotate import AnnotatedGraph
from ..annotate.batch_norm import restore_forward, swap_recomputed
from ..annotate.dropout_replay import dropout_replay_sources, replay_scale
from ..compat import extract_fwd_bwd_modules, graph_module, is_fake, is_symbolic
from ..errors import RematError

logger = logging.getLogger(__name__)


def rewrite(annotated: AnnotatedGraph, plan: Plan) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split the joint graph as ``plan`` says; returns ``(forward_module, backward_module)``."""
    if plan.problem is not annotated.problem:
        raise RematError("plan was made for a different problem than the one being rewritten")
    joint = annotated.joint
    module, copies = _copy_module(joint.module)  # rewriting never touches the annotated graph
    nodes = [copies[node] for node in annotated.nodes]
    views = views_made_again(annotated.problem, plan, nodes)  # not saved beside their base
    saved_values, saved_symbols = _saved_nodes(annotated, plan, nodes, views)
    saved_values += offload.saved_bases(annotated.problem, plan, nodes)
    recomputed_names = {nodes[i].name for i in plan.recomputed | views.views} | offload.rebuilt_views(annotated.problem, plan, nodes)
    refreshed_names = {nodes[i].name for i in plan.refreshed}
    for name, rebuilt in _replay_dropouts(module.graph, nodes, plan).items():
        recomputed_names |= rebuilt
        if name in refreshed_names:
            refreshed_names |= rebuilt
    swapped = swap_recomputed(module.graph, recomputed_names)  # backward's BatchNorm without running stats
    forward, backward = extract_fwd_bwd_modules(module, saved_values, saved_symbols, joint.num_fwd_outputs,
                                                joint.partition_kwargs.get("static_lifetime_input_indices"))
    restore_forward(forward.graph, swapped)
    _drop_unused_forward_copies(backward.graph, annotated, recomputed_names)
    _check_recomputation(backward, annotated, recomputed_names)
    _own_fake_values(backward.graph, recomputed_names)
    _schedule_just_in_time(backward.graph, recomputed_names, frozenset(refreshed_names))
    if plan.offloaded:
        steps = offload.backward_step_names(joint.module.graph)
        offload.emit(forward, backward, annotated.problem, plan, nodes, steps)
    for module in (forward, backward):
        module.graph.lint()
        module.recompile()
    return forward, backward


def _copy_module(module: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``module`` whose nodes share names and ``meta`` (fake values) with the original."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    result, output = graph.graph_copy(module.graph, copies, return_output_node=True)
    new_output = graph.output(result)
    new_output.meta.update(output.meta)
    return graph_module(module, graph), copies


def _replay_dropouts(graph: fx.Graph, nodes: list[fx.Node], plan: Plan) -> dict[str, set[str]]:
    """Replace each recomputed dropout output by ``input * mask * scale`` in the joint graph.

    The dropout op still runs once in forward, for its mask; every reader of its output,
    in forward and in backward, reads the rebuilt product instead, so backward can redo it
    from the kept mask without drawing random numbers (each time: a refreshed one is rebuilt in
    every step that needs it, from the same mask). Returns the new nodes' names per dropout output.
    """
    names: dict[str, set[str]] = {}
    for i in sorted(plan.recomputed):
        output = nodes[i]
        sources = dropout_replay_sources(output)
        if sources is None:
            continue
        source, mask = sources
        scale = replay_scale(output.args[0].args[1])
        # aten's ``input.mul(mask).mul_(scale)`` out of place (graphs stay functional), as
        # ``dropout_replay.replay`` checks it: the product is a transient second tensor, which
        # the memory models account for.
        with graph.inserting_after(output):
            masked = graph.call_function(torch.ops.aten.mul.Tensor, (source, mask))
        with graph.inserting_after(masked):
            rebuilt = graph.call_function(torch.ops.aten.mul.Tensor, (masked, scale))
        meta = {k: v for k, v in output.meta.items() if k not in ("remat", "val")}
        value = output.meta["val"]
        for node in (masked, rebuilt):
            with value.fake_mode:  # storages of their own, so memory simulation sees both tensors
                fresh = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
            node.meta.update(meta, val=fresh)
        output.replace_all_uses_with(rebuilt)
        graph.erase_node(output)
        names[output.name] = {masked.name, rebuilt.name}
    return names


def _saved_nodes(annotated: AnnotatedGraph, plan: Plan, nodes: list[fx.Node],
                 views: ViewsMadeAgain) -> tuple[list[fx.Node], list[fx.Node]]:
    """Kept values but the views made again in backward, with their saved bases, plus the available
    inputs (parameters, inputs, symbols) backward reads."""
    problem = annotated.problem
    made_again = plan.recomputed | views.views
    needed = set(problem.backward_reads) | set(plan.kept)
    for i in made_again:
        needed.update(problem.values[i].inputs)
    tensors, symbols = [], []
    for i in sorted(needed - made_again):
        node = nodes[i]
        if is_symbolic(node.meta.get("val")):
            symbols.append(node)
        elif i in plan.kept or i in views.bases or node.op == "placeholder":
            tensors.append(node)  # constants (get_attr) are not passed: extraction copies them
    return tensors, symbols


def _drop_unused_forward_copies(graph: fx.Graph, annotated: AnnotatedGraph, recomputed_names: set[str]) -> None:
    """Erase forward ops that extraction copied into backward although nothing reads them.

    Extraction copies every node whose inputs are present; dead-code elimination then keeps
    the impure ones, so a dropout whose input happens to be recomputed would run again in
    backward (drawing random numbers for nothing).
    """
    forward_names = {node.name for node in annotated.nodes}
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node.name in forward_names - recomputed_names:
            graph.erase_node(node)


def _check_recomputation(backward: fx.GraphModule, annotated: AnnotatedGraph, recomputed_names: set[str]) -> None:
    """The backward graph must recompute exactly what the plan says, nothing more."""
    forward_names = {node.name for node in annotated.nodes}
    present = {node.name for node in backward.graph.nodes if node.op == "call_function" and node.name in forward_names}
    extra = present - recomputed_names
    if extra:
        raise RematError(
            f"internal error: backward recomputes values the plan keeps or never chose: {sorted(extra)[:10]}"
        )


def _schedule_just_in_time(graph: fx.Graph, recomputed_names: set[str], refreshed_names: frozenset[str] = frozenset()) -> None:
    """Move each recomputed node to just before the first backward node that needs it.

    Backward's own nodes keep their order; a recomputed node is emitted (with its recomputed
    inputs, depth first) only when a consumer is about to run. A refreshed node (multiple
    recomputation, ``Plan.refreshed``) is emitted afresh for every backward node that needs it,
    directly or through other recomputed nodes, and that node reads its own copy, so FX frees
    each copy after the step; so are backward views of a refreshed node, which the plan's
    model counts as reads of the refreshed value itself.
    """
    nodes = list(graph.nodes)
    is_recompute = {node: node.name in recomputed_names for node in nodes}
    per_step = {node for node in nodes if node.name in refreshed_names}
    for node in nodes:  # backward views of a refreshed tensor travel with it
        if not is_recompute[node] and node.op == "call_function" and any(
                source in per_step and _aliases(node, source) for source in node.all_input_nodes):
            per_step.add(node)
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()
    used: set[fx.Node] = set()  # per-step nodes whose original has been emitted once

    def place(root: fx.Node) -> None:
        batch: dict[fx.Node, fx.Node] = {}  # per-step node -> the instance this root's batch uses
        stack = [(root, False)]
        while stack:
            node, inputs_done = stack.pop()
            copied = node in per_step and node is not root
            if (node in batch) if copied else (node in placed):
                continue
            if not inputs_done:
                stack.append((node, True))
                for source in reversed(node.all_input_nodes):
                    if (source in per_step and source not in batch) or (
                            source not in per_step and source not in placed and is_recompute.get(source, False)):
                        stack.append((source, False))
                continue
            instance = node
            if copied and node in used:
                instance = graph.node_copy(node, lambda n: batch.get(n, n))
                instance.meta["val"] = _fresh_value(instance)
            else:
                rewired = [source for source in node.all_input_nodes if batch.get(source, source) is not source]
                stale = any(_aliases(node, source) for source in rewired)
                for source in rewired:
                    node.replace_input_with(source, batch[source])
                if stale:  # a view of a copy: its fake value must share the copy's storage
                    node.meta["val"] = _fresh_value(node)
                used.add(node)
            if copied:
                batch[node] = instance
            else:
                placed.add(node)
            order.append(instance)

    for node in nodes:
        if not is_recompute[node]:
            place(node)
    order = _unpack_at_once(order)
    previous = None
    for node in order:
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node
    copies = len(order) - len(set(nodes) & set(order))
    logger.debug("just-in-time schedule: %d backward nodes, %d copies of refreshed nodes", len(order), copies)


def _unpack_at_once(order: list[fx.Node]) -> list[fx.Node]:
    """Move each tuple's ``getitem`` readers to right after it.

    FX code holds a tuple until its last ``getitem``, and the tuple holds every element: a
    recomputed BatchNorm whose saved statistics are first read late in backward would keep its
    (large) output alive until then. Unpacked at once, each element lives as long as its own
    readers, as the plan's memory model counts it.
    """
    placed = set(order)
    unpacked: list[fx.Node] = []
    moved: set[fx.Node] = set()
    for node in order:
        if node in moved:
            continue
        unpacked.append(node)
        for user in node.users:
            if user.target is operator.getitem and user in placed and user not in moved:
                unpacked.append(user)
                moved.add(user)
    return unpacked


def _own_fake_values(graph: fx.Graph, recomputed_names: set[str]) -> None:
    """Give each recomputed node (and each backward view of one) a fake value of its own.

    Extraction copies a recomputed node with the fake value traced in forward, so the memory
    replay would take the recomputed tensor for the forward one: for free when that storage is
    kept through another value (a kept view of a softmax while the softmax is recomputed),
    though backward then really holds two. Values are rebuilt from the inputs' values in
    graph order, so views stay views of what they view."""
    traced: dict[fx.Node, Any] = {}  # the replaced values, to tell views of them
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        stale = any(source in traced and _shares_storage(node.meta.get("val"), traced[source])
                    for source in node.all_input_nodes)
        if node.name in recomputed_names or stale:
            old = node.meta.get("val")
            try:
                node.meta["val"] = _fresh_value(node)
            except Exception as error:  # an op fake tensors cannot run: keep the traced value
                logger.debug("no fresh fake value for %s: %s", node.format_node(), error)
                continue
            traced[node] = old


def _aliases(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node``'s output shares a storage with ``source``'s (a view of it)."""
    return _shares_storage(node.meta.get("val"), source.meta.get("val"))


def _shares_storage(value: Any, other: Any) -> bool:
    outputs = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    inputs = [t for t in tree_flatten(other)[0] if isinstance(t, torch.Tensor)]
    try:
        keys = {StorageWeakRef(t.untyped_storage()) for t in inputs}
        return any(StorageWeakRef(t.untyped_storage()) in keys for t in outputs)
    except (NotImplementedError, RuntimeError):
        return False


def _fresh_value(node: fx.Node) -> Any:
    """The fake value of a copied node, from its own inputs' values: a copy of a view shares its
    base copy's storage, anything else gets a storage of its own (the memory replay needs both)."""
    val = node.meta.get("val")
    fake = next((t for t in tree_flatten(val)[0] if is_fake(t)), None)
    if fake is None:
        return val
    args, kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    with fake.fake_mode:
        return node.target(*args, **kwargs)
