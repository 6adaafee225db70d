"""Make the captured joint graph hold what the model as given holds, no more.

AOTAutograd's joint graph differs from eager autograd in ways that would make the captured
keep-all plan save more than eager does, and it carries the model's own checkpointing as node
metadata that the planner must read. ``annotate`` applies these before building the Problem:

* ``drop_identity_copies``: copies that functionalization made of what eager aliases
  (``dropout(p=0)``, same-dtype ``.to()``) are replaced by the original;
* ``derived_in_backward``: tangent-free parts of derivative formulas are backward nodes, as
  eager computes them in backward from what it saved (untagged nodes a graph pass made too,
  where only backward reads them);
* ``checkpoint_tags``: a ``torch.utils.checkpoint`` region's recompute decisions, as the
  ``Tag.CHECKPOINTED`` tag ``baseline.as_given_plan`` reads.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from remat_pass.solvers.tags import Tag


def _outputs(graph: fx.Graph) -> list[fx.Node | None]:
    output = next(iter(graph.find_nodes(op="output")))
    return [a if isinstance(a, fx.Node) else None for a in output.args[0]]


def _storage_keys(node: fx.Node) -> set[StorageWeakRef]:
    keys = set()
    for tensor in tree_flatten(node.meta.get("val"))[0]:
        if isinstance(tensor, torch.Tensor):
            try:
                keys.add(StorageWeakRef(tensor.untyped_storage()))
            except (NotImplementedError, RuntimeError):
                continue
    return keys


def derived_in_backward(graph: fx.Graph, backward: set[fx.Node], num_fwd_outputs: int) -> set[fx.Node]:
    """Tangent-free nodes that AOTAutograd traced as part of a backward formula.

    A derivative formula often computes something from saved forward values alone before it
    meets the gradient (``pow``'s backward makes ``2 * x``, ``rsqrt``'s makes ``y ** 3``).
    Eager autograd saves ``x`` and computes these in backward; counted as forward values they
    would be kept next to ``x``, and the keep-all plan would hold more than eager does (1.06x
    on a tiny Llama). They belong to backward: backward then reads their inputs instead.
    Nodes a forward output needs stay forward whatever their tag.

    A node a graph pass made after tracing has no tag (Inductor's joint-graph patterns rewrite
    ``nll_loss_backward``'s scatter into ``where(eq(iota, target), -1, 0)`` and tag only the
    ``where``): it is backward when every reader is. Counted as forward, the one-hot ``eq`` was
    kept, so the compiled forward computed and stored a (tokens, vocab) mask that eager and
    torch.compile's own partition compute in backward.
    """
    derived = {
        node for node in graph.nodes
        if node.op == "call_function" and node not in backward and node.meta.get("partitioner_tag") == "is_backward"
    }
    if not derived:
        return set()
    for node in reversed(graph.nodes):  # readers first: an untagged chain joins backward whole
        if (node.op == "call_function" and node not in backward and "partitioner_tag" not in node.meta
                and not _draws_random_numbers(node)
                and node.users and all(user in backward or user in derived for user in node.users)):
            derived.add(node)
    needed: set[fx.Node] = set()
    stack = [n for n in _outputs(graph)[:num_fwd_outputs] if n is not None]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return derived - needed


def _draws_random_numbers(node: fx.Node) -> bool:
    """A random op stays where it was traced: moved to backward it would draw other numbers."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


_IDENTITY_COPIES = {"clone", "_to_copy"}


def drop_identity_copies(graph: fx.Graph) -> None:
    """Replace exact copies of intermediate values by the values themselves (in place).

    Functionalization turns what eager aliases into copies: ``dropout(x, p=0)`` in training and
    ``.to()`` to the same dtype return ``x`` itself in eager but ``clone(x)`` / ``_to_copy(x)`` in
    the graph. Where backward reads both (softmax's backward its output, the next matmul's
    backward a view of the "dropped-out" copy), keep-all would save two storages where eager
    saves one. The copy equals ``x`` bit for bit (same shape, strides, dtype, device), and an
    op's output is never mutated in a functional graph, so its readers may read ``x``. Copies of
    graph inputs (the step may mutate them) and copies the graph returns (AOTAutograd has
    already recorded how outputs alias, so neither a copy returned nor one a returned view reads)
    stay.
    """
    returned = {key for node in next(iter(graph.find_nodes(op="output"))).all_input_nodes for key in _storage_keys(node)}
    dropped: set[StorageWeakRef] = set()
    for node in list(graph.nodes):
        original = _copied_from(node)
        if original is not None and StorageWeakRef(node.meta["val"].untyped_storage()) not in returned:
            dropped.add(StorageWeakRef(node.meta["val"].untyped_storage()))
            node.replace_all_uses_with(original)
            graph.erase_node(node)
    if dropped:
        _refresh_views(graph, dropped)


def _refresh_views(graph: fx.Graph, dropped: set[StorageWeakRef]) -> None:
    """Views of a dropped copy now view the original: recompute their fake values (graph order
    is topological, so each view's input is refreshed first), so that storages stay shared."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            continue
        try:
            if StorageWeakRef(val.untyped_storage()) not in dropped:
                continue
        except (NotImplementedError, RuntimeError):
            continue
        meta = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
        with val.fake_mode:
            node.meta["val"] = node.target(*tree_map(meta, node.args), **tree_map(meta, node.kwargs))


def _copied_from(node: fx.Node) -> fx.Node | None:
    """The op output ``node`` is an exact copy of, or None."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.overloadpacket.__name__ not in _IDENTITY_COPIES or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.op != "call_function":
        return None
    copy, original = node.meta.get("val"), source.meta.get("val")
    if not (isinstance(copy, torch.Tensor) and isinstance(original, torch.Tensor)):
        return None
    if (copy.dtype, copy.device, copy.layout) != (original.dtype, original.device, original.layout):
        return None
    sizes = [*zip(copy.shape, original.shape), *zip(copy.stride(), original.stride()),
             (copy.storage_offset(), original.storage_offset())]
    same = copy.dim() == original.dim() and all(statically_known_true(a == b) for a, b in sizes)
    return source if same else None


def checkpoint_tags(node: fx.Node) -> set[str]:
    """The model's own checkpointing: AOTAutograd marks each node of a ``torch.utils.checkpoint``
    region with a ``CheckpointPolicy`` (``node.meta["recompute"]``); the recompute policies
    are what the model as given recomputes (``baseline.as_given_plan``)."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    if node.meta.get("recompute") not in recompute:
        return set()
    # As AOTAutograd's ``cleanup_recompute_tags`` (run by its partitioners, after ours reads the
    # graph): a region's output that a later region reads is its input, which eager saves.
    region = node.meta.get("ac_graph_id")
    later = [u for u in node.users if u.meta.get("recompute") in recompute and u.meta.get("ac_graph_id") is not None]
    if region is not None and any(u.meta["ac_graph_id"] > region for u in later):
        return set()
    if node.meta.get("has_backward_hook", False) and not later:
        return set()
    return {Tag.CHECKPOINTED}


__all__ = ["checkpoint_tags", "derived_in_backward", "drop_identity_copies"]
