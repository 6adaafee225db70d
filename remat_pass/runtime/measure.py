"""Run-time measurements that check the planner's predictions against what really happens.

``saved_activation_bytes`` counts what autograd actually holds for backward; the plan's
``kept_bytes`` must equal it. Parameters, buffers and inputs are excluded because they are
alive anyway; that is the same line the planner draws with "available" values.

``allocator_peak`` (and its shorthands ``peak_activation_bytes``, ``held_bytes``) is the third of
the three memory accounts, the measurement: what the allocator really did. The other two are
predictions: ``solvers.analysis.memory.simulate_plan`` (``PlanMemory``, the plan-level model the planners
use) and ``remat_pass.rewrite.simulate.simulate`` (``GraphMemory``, an independent replay of the rewritten
graphs). The tests and the benchmarks both measure with this module.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import torch

from ..compat import allocator_events, cuda_allocator_events, running_quietly

T = TypeVar("T")


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr())


def saved_activation_bytes(fn: Callable[[], T], exclude: Iterable[torch.Tensor] = ()) -> tuple[T, int]:
    """Call ``fn`` (a forward) and return its result and the bytes autograd saved for backward meanwhile.

    Each storage is counted once, at its full size (a saved view holds its whole base alive);
    storages shared with a tensor in ``exclude`` (pass parameters, buffers, inputs) count 0.
    Only what is still saved when ``fn`` returns counts: an op that runs autograd inside itself
    (the chunked loss computes each chunk's gradients with ``torch.autograd.grad``) saves and
    frees tensors within the call, which backward never holds. So ``fn`` must not run the
    backward itself: what that frees is not counted either.

    >>> model = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4)
    >>> _, nbytes = saved_activation_bytes(lambda: model(x).relu(), exclude=[x, *model.parameters()])
    >>> nbytes  # the relu output (2*4 floats); x and the weight are excluded
    32
    """
    excluded = {_storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
    packs: list[tuple[weakref.ref[_Saved], tuple[str, int], int]] = []

    def pack(tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor, tensor._version)
        key = _storage_key(tensor)
        if key not in excluded and tensor.untyped_storage().data_ptr() != 0:
            packs.append((weakref.ref(saved), key, tensor.untyped_storage().nbytes()))
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, _Saved.unpack):
        result = fn()
    held = {key: nbytes for alive, key, nbytes in packs if alive() is not None}
    return result, sum(held.values())


class _Saved:
    """A tensor autograd saved, its version then, and a weak reference's anchor: alive as long as
    a graph node holds it."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version

    def unpack(self) -> torch.Tensor:
        # With hooks installed autograd skips its own check that a saved tensor was not modified
        # in place before backward; do it here, so measuring never hides such a bug.
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a saved {tuple(self.tensor.shape)} tensor is at version {self.tensor._version}; "
                f"expected version {self.version}"
            )
        return self.tensor


@dataclass(frozen=True)
class AllocatorPeak:
    """What the allocator saw during a call, relative to what was live before it.

    ``peak`` counts every allocation; ``peak_excluding`` leaves out the allocations still alive
    at the end as one of the ``survivors`` (the parameter gradients), so it is the
    activations-and-temporaries peak. ``end`` is what the call left allocated; ``events`` how many
    allocator events were replayed.
    """

    peak: int
    peak_excluding: int
    end: int
    events: int


def _profiled(fn: Callable[[], T]) -> tuple[T, Any]:
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # CPU activity is enough: allocator events of every device are reported through it.
        with running_quietly(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof:
            result = fn()
    return result, prof


def _replay(events: list[tuple[int, int, int]], survivors: Iterable[torch.Tensor | None]) -> AllocatorPeak:
    kept = {t.untyped_storage().data_ptr() for t in survivors if t is not None}
    # The last allocation at a survivor's address is the survivor itself.
    last_allocation = {ptr: index for index, (_, ptr, size) in enumerate(events) if size > 0 and ptr in kept}
    excluded = set(last_allocation.values())
    live = live_excluding = peak = peak_excluding = 0
    for index, (_, _, size) in enumerate(events):
        live += size
        if index not in excluded:
            live_excluding += size
        peak, peak_excluding = max(peak, live), max(peak_excluding, live_excluding)
    return AllocatorPeak(peak, peak_excluding, live, len(events))


def allocator_peak(
    fn: Callable[[], Any],
    device: torch.device | str = "cpu",
    survivors: Callable[[], Iterable[torch.Tensor | None]] = lambda: (),
) -> AllocatorPeak:
    """Run ``fn`` under the profiler with ``profile_memory`` and replay its allocator events.

    ``fn``'s result is dropped before the profiler stops, so ``end`` is what ``fn`` left behind
    beyond its result. On CUDA the caching allocator's own history is replayed instead
    (``compat.cuda_allocator_events``): the profiler misses frees made on autograd's CUDA thread. On CPU a free is only reported for a block whose allocation the profiler
    saw, so blocks live before the call never show: the timeline starts at 0 by construction.

    >>> measured = allocator_peak(lambda: torch.empty(1000))
    >>> measured.peak, measured.end  # the tensor is freed when the lambda's result is dropped
    (4000, 0)
    """

    def call_and_drop() -> list[torch.Tensor | None]:
        result = fn()
        kept = list(survivors())
        del result
        return kept

    where = torch.device(device)
    if where.type == "cuda":
        kept, events = cuda_allocator_events(call_and_drop, where)
        return _replay(events, kept)
    kept, prof = _profiled(call_and_drop)
    return _replay(allocator_events(prof, where.type), kept)


def peak_activation_bytes(fn: Callable[[], T], survivors: Callable[[], Iterable[torch.Tensor]] = lambda: ()) -> tuple[T, int]:
    """Call ``fn``; return its result and the peak of bytes allocated during it (allocator level).

    The CPU allocator's ``allocator_peak(...).peak_excluding``, with ``fn``'s result returned:
    memory allocated before the call (parameters, inputs) never counts, and neither does the
    last allocation at the address of each tensor ``survivors()`` returns after the call (pass
    the parameter gradients), so the number is the peak of activations and temporaries. Works
    for CPU; on CUDA prefer ``torch.cuda.max_memory_allocated``.
    """
    result, prof = _profiled(fn)
    return result, _replay(allocator_events(prof, "cpu"), survivors()).peak_excluding


def held_bytes(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, int]:
    """``fn``'s result and the bytes allocated during ``fn`` that are still live when it returns.

    For a forward pass that is what the autograd graph holds for backward (saved tensors,
    checkpoint RNG states, recomputation caches, compiled graphs' saved activations), plus the
    outputs. The caller drops the result.
    """
    result, prof = _profiled(fn)
    return result, sum(size for _, _, size in allocator_events(prof, torch.device(device).type))
