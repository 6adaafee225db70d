"""Which nn.Module each joint-graph node belongs to: the path blocks, ``per_block`` and
``per_module`` group by.

Dynamo records a module stack on the nodes it traces; AOTAutograd records the forward module on
the backward helpers it makes (``fwd_nn_module_stack``); a few passes leave nodes with nothing,
and those inherit their producers' (else consumers') module, so no value falls outside its block.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from torch import fx

from remat_pass.solvers.problem import Value

_MODULE_PATH_PARTS = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]")


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost nn.Module that produced ``node`` ("blocks.0.attn").

    A node AOTAutograd made while tracing backward (a ``t`` or ``detach`` of an activation
    that backward reads, the ``3 * x**2`` of a ``pow``'s derivative) has no
    ``nn_module_stack`` but a ``fwd_nn_module_stack``: the module whose forward op it
    differentiates, which is where it belongs. "" when neither is recorded.
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    raw = _innermost_model_module(raw for raw, _type in stack.values())
    raw = re.sub(r"^L\[['\"]\w+['\"]\]\.?", "", raw)  # the root module, whatever its local name
    path = _MODULE_PATH_PARTS.sub(lambda m: "." + next(g for g in m.groups() if g is not None), raw)
    return path.strip(".").replace("..", ".")


def _innermost_model_module(raws: Iterable[str]) -> str:
    """The innermost module on the stack that is part of the traced model, skipping modules
    Dynamo reached through a global (``G['…']``; the model's own are a local's, ``L['self'].…``).

    transformers 5.25's hub kernels wrap functions such as Llama's ``apply_rotary_pos_emb`` in a
    module held by a module-level global; the ops inside it belong to the layer that called it,
    or a per-layer plan would treat them as code between blocks. "" (the root) when every entry
    is a global's.
    """
    return next((raw for raw in reversed(list(raws)) if not raw.startswith("G[")), "")


def fill_module_attribution(values: list[Value], nodes: list[fx.Node]) -> None:
    """Give every computed value whose node says nothing about its module one: its producers'
    module, else its consumers'.

    Passes after Dynamo (decompositions, the joint trace) can add nodes with no module stack
    and no source location at all. Left empty, such a value belongs to no block, so
    ``per_block`` keeps it, block detection misses it and ``per_module`` shows it nowhere. It
    inherits the module of its first computed input that has one (in topological order, so
    chains of such nodes inherit too), else of its first reader that has one. Code that runs
    in the root module's own forward (a loss computed there) has a source location and keeps
    "" (it is in no submodule); available values (inputs, parameters) stay "".
    """
    users: list[list[int]] = [[] for _ in values]
    for value in values:
        for source in value.inputs:
            users[source].append(value.id)
    unattributed = [
        not value.module and not value.available and not _has_attribution(node)
        for value, node in zip(values, nodes)
    ]
    for index, value in enumerate(values):
        if unattributed[index]:
            found = next((values[u].module for u in value.inputs if values[u].module and not values[u].available), "")
            values[index] = replace(value, module=found)
    for index in reversed(range(len(values))):
        if unattributed[index] and not values[index].module:
            found = next((values[u].module for u in users[index] if values[u].module), "")
            values[index] = replace(values[index], module=found)


def _has_attribution(node: fx.Node) -> bool:
    """Whether tracing recorded where ``node`` comes from (a module stack or a source location)."""
    keys = ("nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack", "stack_trace")
    return any(node.meta.get(key) for key in keys)
