"""The attention core: values between two activation-by-activation matmuls (scale, mask,
softmax, dropout), tagged so that Megatron-style selective recompute and reports can name them.

Torch-free: it reads only the planner's ``Value`` records. ``ignored_storages``: storages that
are not activations (the one shared by values that hold no bytes of their own).
"""

from __future__ import annotations

from dataclasses import replace

from remat_pass.solvers.problem import Value
from remat_pass.solvers.tags import Tag


def _is_activation_matmul(value: Value, values: list[Value], storage_bytes_zero: set[int]) -> bool:
    """A matmul of two activations (Q·Kᵀ, P·V), not of an activation and a weight."""
    if Tag.MATMUL not in value.tags or len(value.inputs) < 2:
        return False
    return all(values[i].storage not in storage_bytes_zero for i in value.inputs)


def tag_attention_core(values: list[Value], ignored_storages: set[int]) -> None:
    """Tag the values between two activation-by-activation matmuls: the attention core.

    From each such matmul, walk forward through non-matmul values; if another activation
    matmul is reached, everything on the way (scale, mask, softmax, dropout) is core, as in
    Megatron-LM's selective recompute.
    """
    available_storages = {v.storage for v in values if v.available} | ignored_storages
    users: list[list[int]] = [[] for _ in values]
    for value in values:
        for source in value.inputs:
            users[source].append(value.id)
    core: set[int] = set()
    for start in values:
        if not _is_activation_matmul(start, values, available_storages):
            continue
        reached, frontier = {start.id}, [start.id]
        while frontier:
            current = frontier.pop()
            for user in users[current]:
                if user not in reached:
                    reached.add(user)
                    if Tag.MATMUL not in values[user].tags:
                        frontier.append(user)
        for end in reached - {start.id}:
            if _is_activation_matmul(values[end], values, available_storages):
                core |= {start.id, end} | _ancestors_within(values, end, reached)
    for i in core:
        values[i] = _with_tag(values[i], Tag.ATTENTION_CORE)


def _ancestors_within(values: list[Value], end: int, region: set[int]) -> set[int]:
    found, frontier = set(), [end]
    while frontier:
        for source in values[frontier.pop()].inputs:
            if source in region and source not in found:
                found.add(source)
                frontier.append(source)
    return found


def _with_tag(value: Value, tag: str) -> Value:
    return replace(value, tags=value.tags | {tag})
