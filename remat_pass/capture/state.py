"""Run a model once without leaving a trace: buffers and random-number state come back as they were.

Capture and plan-ahead run one real forward (Dynamo needs it) before any training step. That
forward advances the RNG (dropout) and updates buffers (BatchNorm running statistics,
``num_batches_tracked``); the first real step must see exactly what it would have seen without
planning, or planning ahead would change the training run. One helper, so that every caller
restores the same things: the CPU generator, the generator of every CUDA device the model or the
inputs live on, and every buffer's value.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["untouched", "untouched_on_error"]


def _cuda_devices(model: nn.Module, inputs: Any) -> list[int]:
    """CUDA devices whose generator the run might advance (the CPU's is always saved)."""
    tensors = [*model.parameters(), *model.buffers(), *(x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor))]
    return sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if t.is_cuda})


@contextlib.contextmanager
def untouched(model: nn.Module, inputs: Any = ()) -> Iterator[None]:
    """Within the block, run ``model`` on ``inputs`` (any pytree) freely; on exit, even on error,
    restore the RNG state and every buffer of ``model``."""
    saved = _buffer_values(model)
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model, inputs)):
            yield
    finally:
        _put_back(saved)


@contextlib.contextmanager
def untouched_on_error(model: nn.Module, inputs: Any, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
    """As ``untouched``, but only where the block raises one of ``errors``: a block that returns keeps
    what it did (a training call that is retried after such an error must see the state it saw), so
    the generators are saved and set here rather than by ``fork_rng``, which always restores."""
    devices = _cuda_devices(model, inputs)
    cpu, cuda = torch.get_rng_state(), [torch.cuda.get_rng_state(device) for device in devices]
    saved = _buffer_values(model)
    try:
        yield
    except errors:
        torch.set_rng_state(cpu)
        for device, state in zip(devices, cuda):
            torch.cuda.set_rng_state(state, device)
        _put_back(saved)
        raise


def _buffer_values(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(buffer, buffer.detach().clone()) for buffer in model.buffers()]


def _put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in saved:
            buffer.copy_(value)
