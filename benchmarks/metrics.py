"""Measurements of one training step: allocator-level peak memory, saved bytes, FLOPs, time, gradients.

Each function takes a zero-argument callable that runs what is measured. See README.md for what
each number means and where it is blind.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

from remat_pass.compat import running_quietly
from remat_pass.annotate.flops import extra_flop_formulas
from remat_pass.runtime.measure import saved_activation_bytes

T = TypeVar("T")


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """``max_memory_allocated`` during ``fn`` minus what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    del result
    return torch.cuda.max_memory_allocated(device) - before


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor]) -> int:
    """Bytes autograd saves for backward while ``fn`` runs (storages once; ``exclude`` counts 0)."""
    _, nbytes = saved_activation_bytes(fn, exclude=exclude)
    return nbytes


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those shared with ``exclude``."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    sizes: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded and storage.data_ptr() != 0:
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def dispatch_flops(fn: Callable[[], Any]) -> int:
    """``FlopCounterMode``'s count while ``fn`` runs.

    Blind to compiled code: with a dispatch mode active, dynamo runs the frames eagerly instead
    of the compiled graphs (torch 2.13), so use it for eager strategies only. Torch has no
    formula for CPU SDPA (``_scaled_dot_product_flash_attention_for_cpu``): remat_pass's
    ``extra_flop_formulas`` adds one.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with warnings.catch_warnings():
        # FlopCounterMode installs global module hooks; torch.compile warns about them.
        warnings.simplefilter("ignore")
        with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
            fn()
    return int(counter.get_total_flops())


def _conv_out_shape(x: Sequence[int], w: Sequence[int], args: list[Any]) -> list[int] | None:
    stride, padding, dilation, transposed, output_padding = (args + [None] * 9)[3:8]
    if transposed or not all(isinstance(v, (list, tuple)) for v in (stride, padding, dilation)):
        return None
    spatial = len(x) - 2
    stride, padding, dilation = ([*v] * spatial if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    out = [
        (x[2 + i] + 2 * padding[i] - dilation[i] * (w[2 + i] - 1) - 1) // stride[i] + 1 for i in range(spatial)
    ]
    return [x[0], w[0], *out]


def _extra_formulas() -> dict[str, Callable[[list[Any]], int]]:
    """``extra_flop_formulas`` by op name, taking the profiler's recorded arguments."""
    return {packet.__name__: (lambda args, formula=formula: int(formula(*args)))
            for packet, formula in extra_flop_formulas().items()}


def _in_place_addmm(args: list[Any]) -> int:
    """``addmm_(self, a, b)``: the chunked loss accumulates its weight gradient in place."""
    a, b = args[1], args[2]
    return 2 * a[0] * a[1] * b[1]


# Ops FlopCounterMode has no formula for (torch 2.13) but that are matmul work all the same.
_EXTRA_FORMULAS = {**_extra_formulas(), "addmm_": _in_place_addmm}


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of the aten ops the profiler saw run, and the registered ops it could not count."""

    total: int
    by_op: dict[str, int]
    uncounted: tuple[str, ...]


def _op_flops(name: str, shapes: list[Any], concrete: list[Any]) -> int:
    from torch.utils.flop_counter import flop_registry

    op = name.split("::", 1)[1]
    args = [torch.Size(s) if s else c for s, c in zip(shapes, concrete)]
    if op in _EXTRA_FORMULAS:
        return _EXTRA_FORMULAS[op](args)
    formula = flop_registry[getattr(torch.ops.aten, op)]
    out: Any = None
    if op in ("convolution", "_convolution"):
        out = _conv_out_shape(args[0], args[1], args)
        if out is None:
            raise ValueError("transposed or unrecorded convolution arguments")
        out = torch.Size(out)
    elif op == "convolution_backward":
        mask = args[10] if len(args) > 10 and isinstance(args[10], (list, tuple)) else [True, True, False]
        out = (args[1] if mask[0] else None, args[2] if mask[1] else None, None)
    # The profiler records trailing scalars (addmm's beta, alpha) that some formulas do not take.
    for count in range(len(args), 0, -1):
        try:
            return int(formula(*args[:count], out_val=out))
        except TypeError:
            continue
    raise ValueError(f"no formula arity fits {name}")


def _is_counted_op(name: str) -> bool:
    from torch.utils.flop_counter import flop_registry

    if not name.startswith("aten::"):
        return False
    op = name.split("::", 1)[1]
    packet = getattr(torch.ops.aten, op, None) if op not in _EXTRA_FORMULAS else None
    return op in _EXTRA_FORMULAS or (packet is not None and packet in flop_registry)


def executed_flops(fn: Callable[[], Any]) -> FlopCount:
    """FLOPs of the matmul, convolution and attention ops that really ran while ``fn`` ran.

    Records every aten op with the profiler (``record_shapes``), so it also sees the ops that
    compiled graphs (aot_eager, inductor's extern kernels, remat_pass's runtime) dispatch, which
    ``FlopCounterMode`` cannot. FLOPs come from ``torch.utils.flop_counter``'s formulas applied
    to the recorded shapes, counting each op once (an op nested in a counted op is its
    implementation, not extra work). Blind to kernels that bypass the dispatcher (inductor or
    triton codegen of a matmul).
    """
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with running_quietly(profile(activities=[ProfilerActivity.CPU], record_shapes=True)) as prof:
            fn()
    total, by_op, uncounted = 0, {}, set()
    for event in prof.events():
        if not _is_counted_op(event.name):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested = _is_counted_op(parent.name)
            parent = parent.cpu_parent
        if nested:
            continue
        try:
            flops = _op_flops(event.name, list(event.input_shapes), list(event.concrete_inputs))
        except Exception:  # noqa: BLE001 - a formula that cannot use recorded shapes
            uncounted.add(event.name)
            continue
        total += flops
        by_op[event.name] = by_op.get(event.name, 0) + flops
    return FlopCount(total, by_op, tuple(sorted(uncounted)))


def time_calls(fn: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    """Seconds per call of ``fn``, synchronizing the device around each."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def timed_once(fn: Callable[[], Any], device: torch.device,
               clock: Callable[[], float] = time.perf_counter) -> tuple[Any, float]:
    """``fn()`` and its seconds by ``clock``: the wall clock, or ``time.thread_time`` for the CPU
    time of a one-thread CPU step (what it costs, without the time a shared machine's other
    processes hold the core; meaningless on a GPU, whose work is not the thread's)."""
    _sync(device)
    start = clock()
    result = fn()
    _sync(device)
    return result, clock() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class GradDiff:
    """How far gradients are from a reference, over all parameters (in fp32).

    ``max_abs``: the largest elementwise difference; ``scaled``: that over the largest reference
    element; ``rel_l2``: norm of the difference over norm of the reference, all parameters as
    one vector (robust to a single ill-conditioned parameter).
    """

    max_abs: float
    scaled: float
    rel_l2: float


def grad_difference(grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]) -> GradDiff:
    if len(grads) != len(reference):
        raise ValueError(f"{len(grads)} gradients against {len(reference)} reference gradients")
    worst = scale = diff_sq = ref_sq = 0.0
    for grad, ref in zip(grads, reference):
        if grad is None and ref is None:
            continue
        if grad is None or ref is None:
            return GradDiff(math.inf, math.inf, math.inf)
        delta = grad.double() - ref.double()
        worst = max(worst, delta.abs().max().item())
        scale = max(scale, ref.abs().max().item())
        diff_sq += delta.pow(2).sum().item()
        ref_sq += ref.double().pow(2).sum().item()
    return GradDiff(worst, worst / scale if scale else worst, math.sqrt(diff_sq / ref_sq) if ref_sq else math.sqrt(diff_sq))
