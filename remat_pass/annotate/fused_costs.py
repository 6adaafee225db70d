"""What Inductor's fusion changes in the model: a recompute's price, and backward tensors never allocated.

The roofline (``costs``) prices every op as a kernel of its own: read its inputs, write its
output, launch. That is the unfused program's cost. Inductor fuses pointwise chains: a recomputed
view or 0-FLOP pointwise value whose readers are themselves fusible (pointwise ops, reductions)
is computed inside its reader's kernel. It is never written; what the recompute adds is reading
its inputs where the reader would have read it, ``max(0, bytes(inputs) - bytes(output))`` over
the device's bandwidth. A unary op (``gelu``, a layer norm's affine, ``exp``) adds nothing; a
binary op adds one input's read. Torch's own partitioner (``min_cut_rematerialization_partition``)
treats such ops as fusible for the same reason.

Measured (benchmarks/VS_INDUCTOR.md, "Fused recompute prices"): priced as unfused kernels, the
planner recomputed HF GPT-2's matmuls (+12.5% FLOPs at torch.compile's default peak) to avoid
recomputing pointwise values that Inductor recomputes for free; priced fused, it recomputes the
pointwise values and no matmul (+0.0%), as torch's own partition does.

A value read by an extern kernel (an op with FLOPs: a matmul, a convolution, an attention, seen
through views) keeps the unfused price: Inductor cannot fuse into those, so the recompute is a
kernel that writes the value out. A reader is counted whether it runs in forward or backward (a
forward reader may be recomputed too): the plan is not known when ops are priced.

The same fusion takes memory out of the backward (``unallocated_in_backward``): a backward-only
tensor made by a pointwise op and read only by kernels Inductor generates (pointwise ops,
reductions, a gather; through views) is computed inside its readers' kernel and never allocated.
The unfused model counted each such tensor: HF Llama's cross-entropy backward (``exp``, ``mul``,
``where`` of the saved log-softmax, each a (tokens, vocabulary) tensor) held three of them at once
where Inductor's one kernel holds the gradient it writes. Only backward-only tensors: forward
values (kept: written out whatever fuses; recomputed: held from their making to their last reader)
keep the unfused account, and Inductor's multi-output kernels, its own order and its in-place
reuse of a dying buffer are not modelled, so under a peak budget the compiled program's peak is
still measured (``runtime.inductor_fit``; benchmarks/VS_INDUCTOR.md, "The backward's fused
tensors": the model's error on the fitted plans, 13.5% on average, is 8.5% with them).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Sequence

import torch
from torch import fx

from remat_pass.solvers.problem import Value
from remat_pass.solvers.tags import Tag

from ..compat import is_view_op
from .costs import DeviceProfile
from .flops import node_flops
from .node_memory import tensor_bytes

# Tags that make a value unsafe or pointless to run twice, whatever its op.
_NEVER = frozenset({Tag.RANDOM, Tag.MUTATION, Tag.COLLECTIVE, Tag.DROPOUT_REPLAY, Tag.PIECE_INPUT})

TIE_BREAK_SHARE = 0.01
"""A fused recompute's price floor, as a share of one kernel launch: among plans that read the
same bytes, the one recomputing fewer values wins, and no fused recompute outweighs a real kernel."""


def is_cheap_op(node: fx.Node, value: Value) -> bool:
    """A view, or a pointwise ATen op with no FLOPs: what Inductor inlines into its readers.

    Factories with no input (``iota``) would be as free, but are left out on evidence: on the
    built-in GPT with tied weights, recomputing the ``iota`` of the loss's backward changed the
    embedding's gradient in the last bits against torch.compile's (the kernels summed it in
    another order)."""
    if node.op != "call_function" or value.flops or value.tags & _NEVER or not value.recomputable:
        return False
    if Tag.VIEW in value.tags:
        return node.target is not operator.getitem  # a multi-output op's piece is that op's work
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def read_by_extern_kernel(node: fx.Node) -> bool:
    """Whether any reader of ``node``'s data, seen through views, is an op with FLOPs (a kernel
    Inductor calls out to rather than generates, so nothing fuses into it)."""
    stack = list(node.users)
    seen: set[fx.Node] = set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view_op(user):
            stack.extend(user.users)
        elif user.op == "call_function" and node_flops(user):
            return True
    return False


_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "any", "all"})
"""Reductions Inductor generates a kernel for, fusing their pointwise producers into its loop."""

_INDEXING = frozenset({"gather", "index"})
"""Indexing Inductor generates as a kernel that loads its input where it indexes (a cross-entropy's
``gather`` of the log-softmax), computing a pointwise input there rather than reading a buffer."""

_GENERATED_OPS = _REDUCTIONS | _INDEXING


def generated_by_inductor(node: fx.Node) -> bool:
    """Whether ``node`` is a kernel Inductor generates, computing its pointwise inputs inside it: a
    pointwise op, a reduction or a gather (not an extern kernel, a scatter or a fallback op, which read
    buffers)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket.__name__ in _GENERATED_OPS


def unallocated_in_backward(order: Sequence[fx.Node], gradients: Sequence[fx.Node | None]) -> frozenset[fx.Node]:
    """The backward-only nodes (``order``, backward's ops in order) whose tensors Inductor never
    allocates: pointwise ops that are not a gradient the step returns and whose every reader, seen
    through views, fuses its producers (``generated_by_inductor``), and the views of those. In a chain of
    such ops only the last is allocated, the one a matmul, another op Inductor does not generate, or
    the return reads."""
    returned = {node for node in gradients if node is not None}
    in_backward = set(order)
    found: set[fx.Node] = set()
    for node in order:
        target = node.target
        if (node in returned or node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
                or torch.Tag.pointwise not in target.tags):
            continue
        if _all_readers_fuse(node, returned, in_backward):
            found.add(node)
    views = [node for node in order if is_view_op(node) and any(source in found for source in node.all_input_nodes)]
    while views:  # the views of an unallocated tensor name no storage of their own either
        found.update(views)
        views = [user for view in views for user in view.users if is_view_op(user) and user not in found]
    return frozenset(found)


def _all_readers_fuse(node: fx.Node, returned: set[fx.Node], among: set[fx.Node]) -> bool:
    """Whether every reader of ``node`` (seen through views) is in ``among`` and fuses its producers;
    the graph's output or a returned node does not."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user in returned or user.op == "output" or user not in among:
            return False
        if is_view_op(user):
            stack.extend(user.users)
        elif not generated_by_inductor(user):
            return False
    return True


def fused_seconds(node: fx.Node, profile: DeviceProfile) -> float:
    """The price of recomputing ``node``'s value fused into its reader: the bytes it reads beyond
    the bytes its reader would have read (inputs that are available cost their read too: a weight
    a broadcast multiplies by is read again), plus a share of a launch as a tie-break."""
    read = sum(tensor_bytes(source.meta.get("val")) for source in node.all_input_nodes)
    extra = max(0, read - tensor_bytes(node.meta.get("val")))
    return extra / profile.bytes_per_second + TIE_BREAK_SHARE * profile.launch_overhead_seconds


def fused_recompute_prices(values: Sequence[Value], nodes: Sequence[fx.Node], profile: DeviceProfile) -> tuple[Value, ...]:
    """``values`` with every cheap op (``is_cheap_op``) that no extern kernel reads priced as a
    recompute fused into its reader (``fused_seconds``) rather than as a kernel of its own."""
    priced = []
    for value, node in zip(values, nodes):
        if value.recompute_seconds and is_cheap_op(node, value) and not read_by_extern_kernel(node):
            seconds = fused_seconds(node, profile)
            value = replace(value, recompute_seconds=min(value.recompute_seconds, seconds))
        priced.append(value)
    return tuple(priced)


__all__ = ["TIE_BREAK_SHARE", "fused_recompute_prices", "fused_seconds", "generated_by_inductor", "is_cheap_op",
           "read_by_extern_kernel", "unallocated_in_backward"]
