"""What dynamo keeps of an ``optimize``d module: nothing that keeps the module alive.

Dynamo keeps every backend it was given for the life of the process (``eval_frame.cached_backends``,
so that a backend's id is never reused), and every graph it compiled stays in the cache of the
model's ``forward`` code object until ``torch._dynamo.reset()``. ``RematModule`` gave torch.compile
its own bound method as the backend and returned closures over itself as the compiled graphs, so
both kept the wrapper, the model, its parameters and their gradients alive after the user dropped
them: a sweep that optimizes one model after another held every model it had made (plain
``torch.compile`` frees them). The backend handed to dynamo and the graphs it returns here hold the
wrapper weakly; what a graph runs lives in the wrapper and goes with it.

The other half: every ``optimize`` of a model of one class compiles the same ``forward`` code object,
and dynamo counted each wrapper's graphs against one ``recompile_limit`` (8), so the ninth model
of a class optimized in one process was refused. Torch 2.13's ``isolate_recompiles`` gives each
``torch.compile`` call its own count, which is what one wrapper's limit means.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Protocol

import torch


class GraphOwner(Protocol):
    """The wrapper: compiles dynamo's graphs and runs them by slot."""

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]: ...

    def _run_slot(self, slot: int, args: tuple[Any, ...]) -> Any: ...


class OwnerBackend:
    """The backend torch.compile keeps: compiles through the owner while it lives."""

    def __init__(self, owner: GraphOwner) -> None:
        self._owner = weakref.ref(owner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return _alive(self._owner)._compile_graph(gm, example_inputs)


def slot_runner(owner: GraphOwner, slot: int, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """The compiled graph dynamo keeps: runs the owner's graph in ``slot``. It takes the calling
    convention of ``compiled`` (``_boxed_call``: its inputs as one list it may clear), nothing else."""
    owner_ref = weakref.ref(owner)

    def run(*args: Any) -> Any:
        return _alive(owner_ref)._run_slot(slot, args)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _alive(owner_ref: weakref.ref[Any]) -> Any:
    owner = owner_ref()
    if owner is None:  # dynamo runs a graph only under the torch.compile call the owner holds
        raise ReferenceError("a graph of an optimized module ran after the module was freed")
    return owner


def compile_apart(module: torch.nn.Module, backend: OwnerBackend, **options: Any) -> Callable[..., Any]:
    """``torch.compile(module, backend=backend, **options)``, its recompiles counted apart from other
    compiles of the same code where torch can (``isolate_recompiles``, torch >= 2.13)."""
    if _can_isolate_recompiles():
        options["isolate_recompiles"] = True
    return torch.compile(module, backend=backend, **options)


@functools.cache
def _can_isolate_recompiles() -> bool:
    return "isolate_recompiles" in inspect.signature(torch.compile).parameters
