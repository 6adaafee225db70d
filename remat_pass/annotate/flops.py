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


def node_flops(node: fx.Node) -> int:
    """FLOPs by torch.utils.flop_counter's formulas (and ``extra_flop_formulas``); 0 for other ops."""
    from torch.utils.flop_counter import flop_registry

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
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
