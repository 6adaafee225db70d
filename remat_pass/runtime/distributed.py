"""How remat_pass composes with data-parallel wrappers, and a clear error where it cannot.

``optimize`` captures the whole forward as one graph. DistributedDataParallel's forward runs
its reducer bookkeeping and logger, and FSDP2's ``fully_shard`` runs all-gather/reshard hooks
that dynamo is told not to trace, so neither can be inside that one graph. What works (and
is tested in ``tests/test_distributed.py``):

* ``DDP(remat_pass.optimize(model))``: plan the module, let DDP wrap the result;
* ``torch.compile(DDP(model), backend=remat_pass.backend(...))``: dynamo's DDPOptimizer splits
  the graph at gradient-bucket boundaries and each piece is planned;
* FSDP2 the torchtitan way: compile each block first (``remat_pass.apply_to_blocks``), then
  ``fully_shard`` each block and the root.
"""

from __future__ import annotations

from torch import nn

from ..errors import CaptureError

_DDP_HINT = (
    "wrap the other way round, DDP(remat_pass.optimize(model)), or compile the DDP module with "
    "torch.compile(ddp_model, backend=remat_pass.backend(budget=...)) (dynamo splits it at gradient "
    "buckets and each piece is planned)"
)
_FSDP_HINT = (
    "compile each block before sharding, as torchtitan does: remat_pass.apply_to_blocks(model, budget=...), "
    "then fully_shard(block) for each block and fully_shard(model)"
)


def reject_wrapped_model(model: nn.Module) -> None:
    """Raise CaptureError if ``model`` is (or contains) a DDP/FSDP wrapper ``optimize`` cannot capture."""
    for name, module in model.named_modules():
        where = "the model" if not name else f"its submodule {name!r}"
        kind = _wrapper_kind(module)
        if kind == "DDP":
            raise CaptureError(
                f"remat_pass.optimize cannot capture {where}, a DistributedDataParallel, as one graph: its "
                f"forward runs DDP's reducer and logger, which torch.compile cannot trace. Instead, {_DDP_HINT}."
            )
        if kind is not None:
            raise CaptureError(
                f"remat_pass.optimize cannot capture {where}, sharded by {kind}, as one graph: its "
                f"all-gather and reshard hooks run outside any graph torch.compile traces. Instead, {_FSDP_HINT}."
            )


def _wrapper_kind(module: nn.Module) -> str | None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "DDP"
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without distributed support
        return None
    if isinstance(module, FSDPModule):
        return "FSDP2 (fully_shard)"
    if isinstance(module, FullyShardedDataParallel):
        return "FSDP (FullyShardedDataParallel)"
    return None
