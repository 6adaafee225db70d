"""A plan's account per nn.Module: what each module keeps, recomputes and offloads (``Plan.per_module``).

Torch-free, like the ``Problem`` and ``Plan`` it reads; the report (``remat_pass.tools.report``) and
``Plan.to_dict`` render these rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .tags import Tag

if TYPE_CHECKING:  # problem.py imports this module for Plan.per_module
    from .problem import Plan


POLICY_NONE, POLICY_SELECTIVE, POLICY_FULL, POLICY_OFFLOAD = "none", "selective", "full", "offload"


@dataclass(frozen=True)
class ModuleRow:
    """One module's share of a plan (``Plan.per_module``). Bytes are storage sizes, each counted once.

    ``recomputed_bytes``: storages rebuilt in backward instead of kept (intermediates keep-all
    never stores, such as a matmul output feeding an activation, count too). ``keep_all_bytes``:
    what the un-rematerialized step keeps here, for comparison.
    """

    module: str
    policy: str
    kept_bytes: int
    recomputed_bytes: int
    keep_all_bytes: int
    recompute_seconds: float
    recompute_flops: int
    kept_values: int
    recomputed_values: int
    offloaded_bytes: int = 0


def module_rows(plan: Plan, depth: int | None) -> list[ModuleRow]:
    """The rows of ``Plan.per_module(depth)`` (its docstring says how bytes are charged)."""
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be a positive number of path parts or None, got {depth}")
    problem = plan.problem
    values = problem.values
    group = [".".join(v.module.split(".")[:depth]) if depth is not None else v.module for v in values]
    owner: dict[int, str] = {}  # storage -> group of the value that created it
    order: dict[str, None] = {}
    for value in values:
        if not value.available:
            owner.setdefault(value.storage, group[value.id])
            order.setdefault(group[value.id], None)

    kept = {values[i].storage for i in plan.kept}
    offloaded = {values[i].storage for i in plan.offloaded}
    recomputed = {values[i].storage for i in plan.recomputed} - kept - offloaded
    keep_all = {values[i].storage for i in problem.backward_reads}
    # A storage other modules read (not merely as a view) is the module's output: a checkpointed
    # module still keeps its output, as the next module's input.
    exported: set[int] = set()
    for value in values:
        for source in value.inputs:
            if group[source] != group[value.id] and Tag.VIEW not in value.tags:
                exported.add(values[source].storage)

    def charged(storages: set[int], name: str) -> int:
        return sum(problem.storage_bytes[s] for s in storages if owner.get(s) == name)

    owners = {owner[s] for s in owner if problem.storage_bytes[s] > 0}
    rows = []
    for name in order:
        mine = [i for i in plan.recomputed if group[i] == name]
        seconds = sum((values[i].recompute_seconds for i in mine), 0.0)
        flops = sum(values[i].flops for i in mine)
        if name not in owners and seconds == 0 and flops == 0:
            continue  # only views and detaches of others' storages (the backward's own "" nodes)
        recomputed_bytes = charged(recomputed, name)
        offloaded_bytes = charged(offloaded, name)
        if offloaded_bytes > 0 and offloaded_bytes >= recomputed_bytes:
            policy = POLICY_OFFLOAD
        elif recomputed_bytes == 0 and seconds == 0 and flops == 0:
            policy = POLICY_NONE
        elif charged(kept - exported, name) == 0:
            policy = POLICY_FULL
        else:
            policy = POLICY_SELECTIVE
        rows.append(ModuleRow(
            module=name, policy=policy, kept_bytes=charged(kept, name), recomputed_bytes=recomputed_bytes,
            keep_all_bytes=charged(keep_all, name), recompute_seconds=seconds, recompute_flops=flops,
            kept_values=sum(1 for i in plan.kept if group[i] == name), recomputed_values=len(mine),
            offloaded_bytes=offloaded_bytes,
        ))
    return rows


__all__ = ["POLICY_FULL", "POLICY_NONE", "POLICY_OFFLOAD", "POLICY_SELECTIVE", "ModuleRow", "module_rows"]
