"""Recomputing training-mode BatchNorm without its running statistics.

In the joint graph, training BatchNorm is ``_native_batch_norm_legit_functional(x, weight,
bias, running_mean, running_var, True, momentum, eps)``, returning ``(out, save_mean,
save_rstd, new_running_mean, new_running_var)``. Recomputed as is in backward, it would read
the running statistics, which AOTAutograd's epilogue updates in place after the forward, so
autograd rejects them as saved tensors. But in training mode the first three outputs depend
on ``x``, ``weight`` and ``bias`` alone: ``_native_batch_norm_legit.no_stats`` computes them
bit for bit (CPU, fp32 and bf16, checked in tests), and ``native_batch_norm_backward`` ignores
the running statistics it is passed when ``train`` is true. So:

* ``drop_running_stats_from_backward``: backward BatchNorm gets ``None`` for them, so backward
  never reads the new statistics (``annotate`` then sees no backward read of them);
* ``running_stat_args``: the arguments a training BatchNorm's recomputation does not need,
  which ``annotate`` leaves out of the value's inputs (and out of the mutated-input pin);
* ``swap_recomputed`` / ``restore_forward``: around AOTAutograd's extraction, a recomputed
  BatchNorm is the ``no_stats`` op, so backward recomputes it from ``x``, ``weight``, ``bias``;
  the forward graph gets the functional op back, which updates the running statistics once.
The new statistics (outputs 3 and 4) are never recomputed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

_aten = torch.ops.aten
FUNCTIONAL = _aten._native_batch_norm_legit_functional.default
NO_STATS = _aten._native_batch_norm_legit.no_stats
BACKWARD = _aten.native_batch_norm_backward.default
RUNNING_STATS = (3, 4)  # argument positions of running_mean / running_var, and their output indices


def is_training_batch_norm(node: fx.Node) -> bool:
    """A functional BatchNorm in training mode (its running statistics play no part in outputs 0-2)
    whose statistics are the step's inputs (buffers). One that reads another BatchNorm's new
    statistics (a module applied twice a step) is left alone: swapped for ``no_stats`` before
    extraction, the first one's new statistics would lose their reader and vanish from the forward."""
    return (node.op == "call_function" and node.target is FUNCTIONAL and node.args[5] is True
            and all(isinstance(node.args[i], fx.Node) and node.args[i].op == "placeholder" for i in RUNNING_STATS))


def running_stat_args(node: fx.Node) -> set[fx.Node]:
    """The running-statistics inputs a training BatchNorm's recomputation does without."""
    if not is_training_batch_norm(node):
        return set()
    return {node.args[i] for i in RUNNING_STATS if isinstance(node.args[i], fx.Node)}


def is_new_running_stat(node: fx.Node) -> bool:
    """Output 3 or 4 (the updated running statistics) of a training BatchNorm: never recomputed."""
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and is_training_batch_norm(node.args[0]) and node.args[1] in RUNNING_STATS)


def drop_running_stats_from_backward(backward_nodes: set[fx.Node]) -> None:
    """Pass ``None`` as running statistics to training-mode ``native_batch_norm_backward``.

    It ignores them when ``train`` is true (bit-identical gradients); passing them would make
    backward read the new statistics, which keeps them alive and ties the BatchNorm's
    recomputation to the buffers updated in place.
    """
    for node in backward_nodes:
        if node.op == "call_function" and node.target is BACKWARD and node.args[7] is True:
            node.args = node.args[:3] + (None, None) + node.args[5:]


@dataclass(frozen=True)
class Swapped:
    """A recomputed BatchNorm swapped for ``no_stats``: its name and the arguments it had."""

    name: str
    args: tuple


def swap_recomputed(graph: fx.Graph, recomputed_names: set[str]) -> list[Swapped]:
    """Make each recomputed training BatchNorm the ``no_stats`` op, before extraction.

    Extraction copies the node into both graphs; the backward copy then needs only ``x``,
    ``weight`` and ``bias`` saved. ``restore_forward`` undoes it in the forward graph.
    """
    swapped = []
    for node in graph.nodes:
        if node.name in recomputed_names and is_training_batch_norm(node):
            swapped.append(Swapped(node.name, node.args))
            x, weight, bias, _, _, training, momentum, eps = node.args
            node.target = NO_STATS
            node.args = (x, weight, bias, training, momentum, eps)
    return swapped


def restore_forward(forward: fx.Graph, swapped: list[Swapped]) -> None:
    """Give the forward copies of swapped BatchNorms their functional op and running statistics back."""
    nodes = {node.name: node for node in forward.nodes}
    for item in swapped:
        node = nodes.get(item.name)
        if node is None:
            continue
        node.target = FUNCTIONAL
        node.args = tuple(nodes[a.name] if isinstance(a, fx.Node) else a for a in item.args)
