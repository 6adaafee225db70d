"""AOTAutograd's donated buffers, turned off only for a compile whose saved tensors share a storage.

Donation (``torch._functorch.config.donated_buffer``, on by default) lets Inductor's backward reuse a
saved tensor's buffer once it has read the tensor for the last time. AOTAutograd donates every saved
tensor that aliases no forward input or output and no gradient; it does not check the saved tensors
against each other. A plan may keep a tensor and views of it (a layer's input and the q/k/v matmuls'
views of it): the backward then reused the tensor's buffer while a view of it was still to be read,
and HF OLMo2's q/k/v weight gradients came out wrong under a peak budget on Inductor
(``tests/test_more_families.py``). Turning donation off for every compile fixed that but cost
backward's reuse everywhere: 7-9% more measured peak on 2-layer HF GPT-2 and BERT (h128, s128) at
saved-bytes budgets (``benchmarks/VS_INDUCTOR.md``, "Donated buffers where they are safe"). So the
partition whose saved tensors share a storage turns donation off for its own compile only.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..compat import stop_donating_buffers

logger = logging.getLogger(__name__)


def saved_tensors_share_storage(forward: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Whether two of ``forward``'s saved tensors (its outputs after the first ``num_fwd_outputs``, as
    AOTAutograd splits them) are views of one storage, by the fake values the trace recorded."""
    output = next(iter(forward.graph.find_nodes(op="output")))
    seen: set[StorageWeakRef] = set()
    for node in output.args[0][num_fwd_outputs:]:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            continue
        storage = StorageWeakRef(value.untyped_storage())
        if storage in seen:
            return True
        seen.add(storage)
    return False


def stop_donating_if_saved_tensors_alias(forward: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Called by the partitioner with the forward it made: AOTAutograd reads the setting right after, and
    the compile's ``compat.donated_buffers_scope`` puts it back when the compile ends."""
    if saved_tensors_share_storage(forward, num_fwd_outputs):
        logger.debug("remat: saved tensors share a storage; this compile donates no buffers")
        stop_donating_buffers()


__all__ = ["saved_tensors_share_storage", "stop_donating_if_saved_tensors_alias"]
