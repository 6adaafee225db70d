"""FLOPs of one graph node: ``torch.utils.flop_counter``'s formulas, plus the ones it lacks.

The annotate stage prices recompute with these (the "flops" profile by them alone, the roofline
as its compute side); the benchmarks count executed FLOPs with the same formulas.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from ..compat import concrete_int as _concrete

logger = logging.getLogger(__name__)


def extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for matmul work that ``torch.utils.flop_counter`` has none for (torch 2.13).

    The CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward)
    does an attention's matmuls but counts 0 there: a FLOP-priced plan would believe recomputing
    it free. In ``FlopCounterMode``'s ``custom_mapping`` convention: tensor arguments as shapes.
    """
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return {}
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: (
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: (
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v)
        ),
    }


def chunked_loss_flops(node: fx.Node) -> int | None:
    """The head matmuls of a chunked loss (``capture.chunked_loss_op``); None for other ops.

    Forward: one ``tokens x hidden x vocab`` matmul (2·T·H·V). Backward: the logits recomputed
    (2·T·H·V, the price of chunking), the hidden's gradient (2·T·H·V) and, when the weight
    needs one, the weight's (2·T·H·V). With the gradients computed in forward: the logits and
    each gradient asked for, once. The softmax and chain are memory-bound and count 0, as
    ``torch.utils.flop_counter`` counts pointwise ops.
    """
    from ..capture.chunked_loss_op import BACKWARD_OP_NAME, OP_NAME, WITH_GRADIENTS_OP_NAME

    name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else ""
    if name not in (OP_NAME, BACKWARD_OP_NAME, WITH_GRADIENTS_OP_NAME):
        return None
    arguments = dict(zip((a.name for a in node.target._schema.arguments), node.args))
    hidden, weight = arguments["hidden"].meta["val"], arguments["weight"].meta["val"]
    head = 2 * _concrete(hidden.shape[0]) * _concrete(hidden.shape[1]) * _concrete(weight.shape[0])
    if name == OP_NAME:
        return head
    if name == WITH_GRADIENTS_OP_NAME:
        return head * (1 + bool(arguments["hidden_grads"]) + bool(arguments["weight_grads"]))
    return head * (3 if arguments["weight_grads"] else 2)


def node_flops(node: fx.Node) -> int:
    """FLOPs by torch.utils.flop_counter's formulas (and ``extra_flop_formulas``, the chunked
    loss's ``chunked_loss_flops``); 0 for other ops."""
    from torch.utils.flop_counter import flop_registry

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    if (chunked := chunked_loss_flops(node)) is not None:
        return chunked
    meta = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    extra = extra_flop_formulas().get(target.overloadpacket)
    if extra is None and target.overloadpacket not in flop_registry:
        return 0
    try:
        if extra is not None:
            shape = lambda a: a.shape if isinstance(a, torch.Tensor) else a  # noqa: E731
            count = extra(*tree_map(shape, tree_map(meta, node.args)))
        else:
            count = flop_registry[target.overloadpacket](
                *tree_map(meta, node.args), **tree_map(meta, node.kwargs), out_val=node.meta.get("val")
            )
    except Exception as error:  # a formula that cannot read fake/symbolic shapes: count 0, say so
        logger.debug("no FLOP count for %s: %s", node.format_node(), error)
        return 0
    return _concrete(count)
