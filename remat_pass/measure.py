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

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        key = _storage_key(tensor)
        if key not in excluded and tensor.untyped_storage().data_ptr() != 0:
            sizes[key] = tensor.untyped_storage().nbytes()
        return tensor, tensor._version

    def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        # With hooks installed autograd skips its own check that a saved tensor was not modified
        # in place before backward; do it here, so measuring never hides such a bug.
        tensor, version = packed
        if tensor._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a saved {tuple(tensor.shape)} tensor is at version {tensor._version}; "
                f"expected version {version}"
            )
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        result = fn()
    return result, sum(sizes.values())


def peak_activation_bytes(fn: Callable[[], T], survivors: Callable[[], Iterable[torch.Tensor]] = lambda: ()) -> tuple[T, int]:
    """Call ``fn``; return its result and the peak of bytes allocated during it (allocator level).

    Replays the allocation and free events ``torch.profiler`` records with
    ``profile_memory=True``: live bytes relative to the start of the call, so memory that was
    allocated before (parameters, inputs) never counts. The last allocation at the address
    of each tensor ``survivors()`` returns after the call (pass the parameter gradients) is
    left out, so the number is the peak of activations and temporaries. Works for CPU; on CUDA
    prefer ``torch.cuda.max_memory_allocated``.
    """
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    kept = {t.untyped_storage().data_ptr() for t in survivors() if t is not None}
    events = _allocation_events(prof)
    last_allocation = {ptr: index for index, (ptr, size) in enumerate(events) if size > 0 and ptr in kept}
    excluded = set(last_allocation.values())
    live = peak = 0
    for index, (_, size) in enumerate(events):
        if index not in excluded:
            live += size
            peak = max(peak, live)
    return result, peak


def _allocation_events(prof: object) -> list[tuple[int, int]]:
    """(address, signed bytes) of the CPU allocator events, in time order."""
    from torch._C._profiler import _EventType

    found: list[tuple[int, int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[attr-defined]
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            found.append((event.start_time_ns, len(found), event.extra_fields.ptr, event.extra_fields.alloc_size))
        stack.extend(event.children)
    found.sort()
    return [(ptr, size) for _, _, ptr, size in found]
