"""What a joint-graph node's value occupies and moves: its storages (views share their base's),
its bytes, its dtype. Shared by ``annotate`` (values) and ``backward_steps`` (backward ops)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from ..compat import concrete_int as _concrete  # symbolic sizes: torch internals live in compat


def storages(node: fx.Node) -> list[tuple[StorageWeakRef, int]]:
    """Each tensor of ``node``'s value as (its storage, the storage's bytes); views name their base's."""
    found = []
    for tensor in tree_flatten(node.meta.get("val"))[0]:
        if isinstance(tensor, torch.Tensor):
            try:
                found.append((StorageWeakRef(tensor.untyped_storage()), _concrete(tensor.untyped_storage().nbytes())))
            except (NotImplementedError, RuntimeError):
                continue
    return found


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse or opaque tensors have no storage
        return False


def dtype_of(val: Any) -> torch.dtype:
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (tuple, list)):
        for item in val:
            if isinstance(item, torch.Tensor):
                return item.dtype
    return torch.float32


def tensor_bytes(val: Any) -> int:
    flat, _ = tree_flatten(val)
    return sum(_concrete(t.numel()) * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def bytes_moved(node: fx.Node) -> int:
    """Bytes read plus bytes written: the memory-bound op's cost."""
    read = sum(tensor_bytes(source.meta.get("val")) for source in node.all_input_nodes)
    return read + tensor_bytes(node.meta.get("val"))
