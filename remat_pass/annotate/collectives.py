"""Collectives in a captured graph: never recomputed, and what recomputing one would cost.

Under DDP, FSDP2 and tensor parallelism the captured graphs contain communication:
``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``all_to_all_single`` and the ``wait_tensor`` that completes each, which is also what DTensor
redistributions (``Shard -> Replicate`` and back) lower to. Only ``wait_tensor`` is marked
side-effecting; the functional collective itself looks like a pure op, so a planner that
judges by purity alone could decide to run it again in backward. It must not: every rank
would have to issue the same collective at the same point (a rank that recomputes alone
deadlocks the group), and each recomputation moves the bytes over the network again. torch's
own partitioner pins them the same way (``force_save_collectives``). ``annotate`` therefore
marks every op in :data:`COLLECTIVE_NAMESPACES` as never recomputed; values computed *from* a
collective's output may still be recomputed, reading the kept output.

:func:`collective_seconds` is the price a recomputation would add — the bytes one rank sends
over its link for a ring algorithm — kept on the value as its ``recompute_seconds`` so plans
and reports show it, and so that a policy which ever allows re-gathering (recompute a sharded
input's all-gather instead of keeping the gathered tensor, as FSDP's reshard-after-forward
does for weights) is priced, not free.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import fx

COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})
"""Operator namespaces of collectives: functional (traced), autograd-aware, and in-place c10d."""

# Per-rank link bandwidth in bytes/s, one direction, by device profile name: NVLink for the
# GPUs (A100 300 GB/s, H100/H200 450 GB/s per direction, ~80% sustained); gloo over loopback
# for "cpu" (a rough, measured-order figure). Used only to price a collective.
LINK_BYTES_PER_SECOND: Mapping[str, float] = {
    "cpu": 2.0e9,
    "a100": 300e9 * 0.8,
    "h100": 450e9 * 0.8,
    "h200": 450e9 * 0.8,
}

# How many times the payload crosses one rank's link in a ring algorithm, times (n-1)/n.
_RING_TRAFFIC = {
    "all_reduce": 2.0, "all_reduce_": 2.0, "all_reduce_coalesced": 2.0, "allreduce_": 2.0,
    "all_gather_into_tensor": 1.0, "all_gather_into_tensor_coalesced": 1.0,
    "reduce_scatter_tensor": 1.0, "reduce_scatter_tensor_coalesced": 1.0,
    "all_to_all_single": 1.0,
}


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` runs (or completes) a collective over a process group."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in COLLECTIVE_NAMESPACES


def collective_seconds(node: fx.Node, payload_bytes: int, device: str) -> float:
    """Seconds one rank spends communicating if ``node`` were run again (0 for ``wait_tensor``).

    ``payload_bytes`` is the larger of the op's input and output (the gathered size).

    Ring algorithms over ``n`` ranks move ``(n-1)/n`` of the (gathered) payload per rank for an
    all-gather, a reduce-scatter or an all-to-all, and twice that for an all-reduce.
    """
    name = node.target.overloadpacket.__name__  # type: ignore[union-attr]
    traffic = _RING_TRAFFIC.get(name)
    if traffic is None:
        return 0.0
    ranks = _group_size(node)
    link = LINK_BYTES_PER_SECOND.get(device, LINK_BYTES_PER_SECOND["h100"])
    return traffic * payload_bytes * (ranks - 1) / ranks / link if ranks > 1 else 0.0


def _group_size(node: fx.Node) -> int:
    schema = node.target._schema  # type: ignore[union-attr]
    for index, argument in enumerate(schema.arguments):
        if argument.name == "group_size":
            value = node.args[index] if index < len(node.args) else node.kwargs.get("group_size")
            return int(value) if isinstance(value, int) else 1
        if argument.name == "group_name":
            name = node.args[index] if index < len(node.args) else node.kwargs.get("group_name")
            return _named_group_size(name)
    return 1


def _named_group_size(name: Any) -> int:
    """The size of a process group by its registered name (1 when it cannot be resolved)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name).size()
    except Exception:  # no process group in this process (planning offline): price as 1 rank
        return 1

