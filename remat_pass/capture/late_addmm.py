"""Undo Inductor's ``add(mm(a, b), c) -> addmm(c, a, b)`` fusion where it delays the matmul.

Inductor's post-grad pattern ``addmm`` (``torch/_inductor/fx_passes/post_grad.py``) fuses a
matmul with the add of its result, and puts the fused ``addmm`` where the add was: where ``c``
is ready. In a backward that is often the end. A model whose embedding is tied to its output
layer accumulates the tied weight's gradient as ``mm(grad_logits^T, hidden) + embedding_grad``;
the embedding's gradient is the last one made, so the fused matmul waits for it and holds the
logits' gradient (batch x seq x vocab) and the final hidden states across the whole backward,
where the unfused program held only the weight-sized product. Our plans are made for the unfused
order, so in our compiles the fusion is undone where it costs memory. Measured under a ``per_block``
plan compiled by Inductor (``benchmarks/results/late_addmm/late_addmm_probe.txt``): HF Falcon (2
layers, h64) 899,080 bytes without this pass, 735,240 with it; the built-in GPT of
``tests/test_late_addmm.py`` 561,416 and 413,960.

:class:`UnfuseLateAddmm` runs as Inductor's ``post_grad_custom_post_pass``, after its pattern
passes. It splits an ``addmm(c, a, b)`` whose ``c`` is made after both matrices back into
``mm(a, b)``, placed as soon as its operands are ready, and an ``add`` where the ``addmm`` was,
when the storages the matmul is the last to read are larger than its product (a graph input's
storage is not counted: its caller may hold it anyway). The price is rounding: ``mm`` then ``add`` is
what eager runs, and it can differ from the ``addmm`` kernel plain ``torch.compile`` runs in the
last bits of such a gradient (equal at 256x128x64 on a CPU, 2.3e-5 apart at 6282x1024x192:
``benchmarks/results/late_addmm/addmm_rounding.txt``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import fx

from ..compat import CustomGraphPass, concrete_int, get_hash_for_files, is_view_op

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def _nbytes(node: fx.Node) -> int:
    """A value's bytes; a symbolic size by its hint, so that the comparison adds no guard."""
    value = node.meta.get("val")
    return concrete_int(value.numel()) * value.element_size() if isinstance(value, torch.Tensor) else 0


def _storage_base(node: fx.Node) -> fx.Node:
    """The node whose buffer ``node`` reads: views (a transpose for the matmul) followed back."""
    while is_view_op(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _readers(base: fx.Node) -> Iterable[fx.Node]:
    """Every node that reads ``base``'s buffer, through any chain of views."""
    pending = [base]
    while pending:
        for user in pending.pop().users:
            if is_view_op(user):
                pending.append(user)
            else:
                yield user


def _is_plain_addmm(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is aten.addmm.default and len(node.args) == 3
            and all(isinstance(arg, fx.Node) for arg in node.args)
            and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1)


def _bytes_freed_early(addmm: fx.Node, position: dict[fx.Node, int]) -> int:
    """Bytes of the matrices' storages that nothing after the matmul reads but the ``addmm``."""
    freed = 0
    for base in {_storage_base(matrix) for matrix in addmm.args[1:]}:
        if base.op != "placeholder" and all(position[reader] <= position[addmm] for reader in _readers(base)):
            freed += _nbytes(base)
    return freed


def _split(graph: fx.Graph, addmm: fx.Node, after: fx.Node) -> None:
    bias, mat1, mat2 = addmm.args
    with graph.inserting_after(after):
        product = graph.call_function(aten.mm.default, (mat1, mat2))
    product.meta["val"] = addmm.meta["val"].clone()
    with graph.inserting_before(addmm):
        total = graph.call_function(aten.add.Tensor, (product, bias))
    total.meta.update(addmm.meta)
    addmm.replace_all_uses_with(total)
    graph.erase_node(addmm)


class UnfuseLateAddmm(CustomGraphPass):
    """Inductor post-grad pass: split an ``addmm`` that Inductor's fusion delayed (see the module)."""

    def __call__(self, graph: fx.Graph) -> None:
        position = {each: index for index, each in enumerate(graph.nodes)}
        for node in [n for n in graph.nodes if _is_plain_addmm(n)]:
            bias, mat1, mat2 = node.args
            ready = max(mat1, mat2, key=position.__getitem__)
            if position[bias] < position[ready]:
                continue  # the bias was ready with the matrices: the fusion delayed nothing
            freed = _bytes_freed_early(node, position)
            if freed <= _nbytes(node):
                continue  # holding the product would cost more than the operands it frees
            logger.debug("unfusing %s: its matmul runs after %s, freeing %d bytes for a %d-byte product",
                         node.name, ready.name, freed, _nbytes(node))
            _split(graph, node, ready)
            position = {each: index for index, each in enumerate(graph.nodes)}

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


class ChainedPostGradPass(CustomGraphPass):
    """A user's own ``post_grad_custom_post_pass`` first, then ours: setting ours must not drop theirs."""

    def __init__(self, first: CustomGraphPass, then: CustomGraphPass) -> None:
        self.first, self.then = first, then

    def __call__(self, graph: fx.Graph) -> None:
        self.first(graph)
        self.then(graph)

    def uuid(self) -> Any:
        first = self.first.uuid()
        return None if first is None else (first, self.then.uuid())


def post_grad_pass_for_our_compiles(configured: Any) -> CustomGraphPass | list[CustomGraphPass]:
    """What ``post_grad_custom_post_pass`` is set to for our compiles, given what the user set."""
    ours = UnfuseLateAddmm()
    if configured is None:
        return ours
    if isinstance(configured, (list, tuple)):  # a torch that takes a list of passes takes ours after them
        return [*configured, ours]
    if not isinstance(configured, CustomGraphPass):
        raise TypeError("torch._inductor.config.post_grad_custom_post_pass is set to "
                        f"{type(configured).__name__}; remat_pass's Inductor compiles chain their own pass after "
                        "it and need a torch._inductor.custom_graph_pass.CustomGraphPass (with uuid())")
    return ChainedPostGradPass(configured, ours)


__all__ = ["ChainedPostGradPass", "UnfuseLateAddmm", "post_grad_pass_for_our_compiles"]
