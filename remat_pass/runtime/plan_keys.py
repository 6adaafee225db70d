"""What selects a compiled graph, as a key for ``RematModule.plans``, and why a new plan was made.

Dynamo compiles a new graph (and remat_pass makes a new plan) when a guard fails: a new input
shape, dtype, device or ``requires_grad``, train/eval, and equally a parameter that was frozen
(``requires_grad_(False)``), cast (``.to(torch.float64)``), moved or resized. The key records all
of these, so that two graphs never share one entry of ``plans`` and the report never describes
a plan that is not running. Guards on other Python state (an attribute forward writes, such as a
Hugging Face config's ``problem_type`` set on the first call) are not in the key; ``RematModule``
therefore also records which plan each call actually ran.

When a new plan is made, ``replan_reason`` says why: Dynamo's own recompile reason (the first
guard that failed, ``compat.last_recompile_reason``) where torch exposes it, and the difference of the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..compat import last_recompile_reason

__all__ = ["PlanKey", "plan_key", "describe_change", "replan_reason"]


TensorMeta = tuple[tuple[int, ...], torch.dtype, str, bool]


def _meta(tensor: torch.Tensor) -> TensorMeta:
    return tuple(tensor.shape), tensor.dtype, str(tensor.device), tensor.requires_grad


@dataclass(frozen=True)
class PlanKey:
    """Train/eval, every input (structure, tensor metadata or value) and every parameter and
    buffer's (shape, dtype, device, requires_grad), in ``named_parameters``/``named_buffers`` order."""

    training: bool
    inputs: tuple[tuple[str, Hashable], ...]
    parameters: tuple[TensorMeta, ...]
    buffers: tuple[TensorMeta, ...]

    def __repr__(self) -> str:
        shown = ", ".join(f"{path}={_show(value)}" for path, value in self.inputs)
        return f"PlanKey({'train' if self.training else 'eval'}, {shown})"


def _show(value: Hashable) -> str:
    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[1], torch.dtype):
        shape, dtype, device, requires_grad = value
        return f"{list(shape)}:{str(dtype).removeprefix('torch.')}{'' if device == 'cpu' else '@' + device}" \
               f"{'(grad)' if requires_grad else ''}"
    return str(value)


def plan_key(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> PlanKey:
    """The key of a call of ``module`` (already in ``inputs.canonical`` form)."""
    return PlanKey(
        training=module.training,
        inputs=(*_leaves("args", args), *_leaves("", dict(kwargs))),
        parameters=tuple(_meta(p) for p in module.parameters()),
        buffers=tuple(_meta(b) for b in module.buffers()),
    )


def _leaves(prefix: str, tree: Any) -> list[tuple[str, Hashable]]:
    """(path, tensor metadata or value) per leaf; paths read "args[0]", "input_ids", "past[1][0]"."""
    leaves, _ = tree_flatten_with_path(tree)
    named = []
    for path, leaf in leaves:
        name = keystr(path)
        if not prefix and path:  # a keyword: its name without the brackets, then any nesting
            name = f"{path[0].key}{keystr(path[1:])}"
        named.append((prefix + name, _meta(leaf) if isinstance(leaf, torch.Tensor) else _hashable(leaf)))
    return named


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def describe_change(old: PlanKey | None, new: PlanKey, module: nn.Module, limit: int = 4) -> str:
    """What differs between two keys, in words: "input_ids: shape [2, 16] -> [2, 8]; ..."."""
    if old is None:
        return "the first training call"
    changes: list[str] = []
    if old.training != new.training:
        changes.append(f"{'train' if old.training else 'eval'} -> {'train' if new.training else 'eval'} mode")
    if [p for p, _ in old.inputs] != [p for p, _ in new.inputs]:
        changes.append(f"inputs {[p for p, _ in old.inputs]} -> {[p for p, _ in new.inputs]}")
    else:
        changes += [f"input {path}: {_diff(a, b)}" for (path, a), (_, b) in zip(old.inputs, new.inputs) if a != b]
    for kind, names, before, after in (
        ("parameter", [n for n, _ in module.named_parameters()], old.parameters, new.parameters),
        ("buffer", [n for n, _ in module.named_buffers()], old.buffers, new.buffers),
    ):
        if len(before) != len(after) or len(names) != len(after):
            changes.append(f"{kind} count {len(before)} -> {len(after)}")
            continue
        changes += _grouped(kind, [(name, _diff(a, b)) for name, a, b in zip(names, before, after) if a != b], limit)
    return "; ".join(changes) or "no change in inputs, parameters or mode (other Python state forward reads)"


def _grouped(kind: str, differing: list[tuple[str, str]], limit: int) -> list[str]:
    """One line per kind of change: "parameter fc.weight: ..." or "12 parameters (a, b, ...): ..."."""
    by_change: dict[str, list[str]] = {}
    for name, change in differing:
        by_change.setdefault(change, []).append(name)
    lines = []
    for change, names in by_change.items():
        if len(names) == 1:
            lines.append(f"{kind} {names[0]}: {change}")
        else:
            shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
            lines.append(f"{len(names)} {kind}s ({shown}): {change}")
    return lines


def _diff(old: Hashable, new: Hashable) -> str:
    fields = ("shape", "dtype", "device", "requires_grad")
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 4:
        return ", ".join(f"{name} {_field(a)} -> {_field(b)}" for name, a, b in zip(fields, old, new) if a != b)
    return f"{_show(old)} -> {_show(new)}"


def _field(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(list(value)) if isinstance(value, tuple) else str(value)


def replan_reason(old: PlanKey | None, new: PlanKey, module: nn.Module) -> str:
    """Why a call made a new plan: Dynamo's guard failure (if any) and what changed in the key."""
    changed = describe_change(old, new, module)
    dynamo = last_recompile_reason() if old is not None else None
    return f"Dynamo recompiled ({dynamo.strip()}); changed: {changed}" if dynamo else changed
