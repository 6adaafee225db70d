"""Run-time measurements that check the planner's predictions against what really happens.

``saved_activation_bytes`` counts what autograd actually holds for backward; the plan's
``kept_bytes`` must equal it. Parameters, buffers and inputs are excluded because they are
alive anyway; that is the same line the planner draws with "available" values.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr())


def saved_activation_bytes(fn: Callable[[], T], exclude: Iterable[torch.Tensor] = ()) -> tuple[T, int]:
    """Call ``fn`` and return its result and the bytes autograd saved for backward meanwhile.

    Each storage is counted once, at its full size (a saved view holds its whole base alive);
    storages shared with a tensor in ``exclude`` (pass parameters, buffers, inputs) count 0.

    >>> model = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4)
    >>> _, nbytes = saved_activation_bytes(lambda: model(x).relu(), exclude=[x, *model.parameters()])
    >>> nbytes  # the relu output (2*4 floats); x and the weight are excluded
    32
    """
    excluded = {_storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
    sizes: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in excluded and tensor.untyped_storage().data_ptr() != 0:
            sizes[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, sum(sizes.values())
