"""Compile each repeated block with one shared remat backend (the torchtitan pattern).

Large models are trained with each transformer block compiled on its own, before FSDP2 shards
it (``torch.compile`` of every block, then ``fully_shard`` of every block and the root): the
sharding hooks stay outside the compiled graphs, and identical blocks compile once. Giving
every block the *same* backend object keeps that property for planning too: dynamo reuses the
first block's graph for the others, so identical blocks share one capture and one plan.

What the budget means here:

* ``per="block"`` (default): the budget is each block's, exactly as for ``remat_pass.backend``.
* ``per="step"``: the budget is for the whole step across the ``n`` blocks. A fraction is the
  same fraction of every block's keep-all bytes (so of their sum too). An absolute size bounds
  the bytes *saved for backward* by all blocks together: each block's plan gets ``1/n`` of it
  as a saved-bytes cap (``remat_pass.backend(..., pieces=n)``). Peaks do not add up across
  blocks (only one block's backward runs at a time), so ``per="step"`` with
  ``budget_kind="peak"`` is refused.

Outside the blocks (embeddings, the final norm, the loss) nothing is planned: their memory
comes on top.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from torch import nn

from .dynamo_backend import RematBackend
from ..planning.pipeline import DEFAULT_BUDGET

logger = logging.getLogger(__name__)

PER_CHOICES = ("block", "step")


def apply_to_blocks(
    model: nn.Module,
    budget: object = DEFAULT_BUDGET,
    *,
    blocks: str | Iterable[nn.Module] | None = None,
    per: str = "block",
    fullgraph: bool = True,
    **backend_options: Any,
) -> RematBackend:
    """Compile every block of ``model`` in place with one shared remat backend; return it.

    ``blocks``: an attribute path to an ``nn.ModuleList``/``nn.ModuleDict`` ("layers",
    "model.layers"), the modules themselves, or None for the largest ModuleList/ModuleDict in
    ``model``. Blocks are compiled with ``nn.Module.compile`` (in place: parameter names and
    ``state_dict`` keys do not change), so call this before ``fully_shard``. The returned
    backend's ``plans`` lists the plans made. ``backend_options`` go to ``remat_pass.backend``.

    >>> import torch, remat_pass
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         return torch.nn.functional.gelu(self.fc(x)) + x
    >>> model = torch.nn.Sequential(*[Block() for _ in range(3)])
    >>> backend = remat_pass.apply_to_blocks(model, budget=0.5, blocks=list(model))
    >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    >>> len(backend.plans)  # three identical blocks, one plan
    1
    """
    if per not in PER_CHOICES:
        raise ValueError(f"per must be one of {PER_CHOICES}, got {per!r}")
    chosen = _resolve_blocks(model, blocks)
    backend = RematBackend(budget, pieces=len(chosen) if per == "step" else 1, **backend_options)
    for block in chosen:
        block.compile(backend=backend, fullgraph=fullgraph, dynamic=False)
    logger.info("compiled %d blocks of %s with one %r", len(chosen), type(model).__name__, backend)
    return backend


def _resolve_blocks(model: nn.Module, blocks: str | Iterable[nn.Module] | None) -> list[nn.Module]:
    if blocks is None:
        containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
        if not containers:
            raise ValueError(
                f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict of blocks; pass blocks= "
                "(an attribute path such as 'layers', or the modules)"
            )
        chosen = list(max(containers, key=len).children())
    elif isinstance(blocks, str):
        try:
            container = model.get_submodule(blocks)
        except AttributeError as error:
            raise ValueError(f"blocks={blocks!r}: {error}") from None
        chosen = list(container.children())
    else:
        chosen = list(blocks)
    if not chosen or not all(isinstance(b, nn.Module) for b in chosen):
        raise ValueError(f"blocks must name or be a non-empty collection of nn.Modules, got {blocks!r}")
    builtin = sorted({type(b).__name__ for b in chosen if type(b).__module__.startswith("torch.nn.")})
    if builtin:
        # Dynamo skips torch.nn's own forward methods as the compiled frame (nothing is planned).
        logger.warning("blocks of torch.nn's own classes (%s) are not compiled by dynamo when compiled alone; "
                       "wrap each in a module class of your own", ", ".join(builtin))
    owned = {id(m) for m in model.modules()}
    stray = [type(b).__name__ for b in chosen if id(b) not in owned]
    if stray:
        raise ValueError(f"blocks must be submodules of the model; not found in it: {stray}")
    return chosen
