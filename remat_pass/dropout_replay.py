"""Dropout outputs rebuilt from their kept mask instead of kept (CPU fp32/fp64, bit-exact).

Random ops are never run again; a dropout output is ``input * mask * scale``, so where those two
multiplications give aten's bits the 1-byte mask and the input are enough for backward.
"""

from __future__ import annotations

import operator

import torch
from torch import fx


def _dropout_getitems(dropout: fx.Node) -> dict[int, fx.Node]:
    return {user.args[1]: user for user in dropout.users if user.target is operator.getitem}


def dropout_replay_sources(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(input, mask) if ``node`` is a dropout output that can be rebuilt bit-exactly from them.

    aten's CPU dropout computes ``input * mask * scale``; redoing those two multiplications
    with the kept boolean mask gives the same bits for fp32/fp64 (checked in the tests), so
    the 4-byte output need not be kept when the 1-byte mask is. CUDA kernels and low
    precision round differently: there the output is kept instead.
    """
    if node.target is not operator.getitem or node.args[1] != 0:
        return None
    dropout = node.args[0]
    if not isinstance(dropout, fx.Node) or dropout.target is not torch.ops.aten.native_dropout.default:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or val.dtype not in (torch.float32, torch.float64):
        return None
    mask = _dropout_getitems(dropout).get(1)
    source = dropout.args[0]
    if mask is None or not isinstance(source, fx.Node) or len(dropout.args) < 3 or dropout.args[2] is not True:
        return None
    return source, mask


def order_dropout_masks(graph: fx.Graph) -> None:
    """Put each dropout's mask right after the dropout, so it precedes the output in topological order."""
    for dropout in graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default):
        mask = _dropout_getitems(dropout).get(1)
        if mask is not None:
            dropout.append(mask)
