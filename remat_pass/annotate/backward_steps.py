"""The backward pass as the peak model sees it: each backward op in order, the forward values it
reads, the backward-only bytes live while it runs and its roofline time (``BackwardStep``)."""

from __future__ import annotations

import operator
from typing import Collection

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat_pass.solvers.problem import BackwardStep

from .costs import DeviceProfile
from .flops import node_flops
from .node_memory import bytes_moved, dtype_of, same_storage, storages


def backward_steps(
    graph: fx.Graph, backward_nodes: set[fx.Node], ids: dict[fx.Node, int], gradients: list[fx.Node | None],
    profile: DeviceProfile, scratch: dict[fx.Node, int], unallocated: frozenset[fx.Node] = frozenset(),
) -> tuple[BackwardStep, ...]:
    """The backward ops in order, each with the forward values it reads, the bytes of
    backward-only tensors live while it runs (allocated at their op, freed after their last
    reader; parameter gradients and anything sharing a forward storage excluded; its kernel's
    scratch included) and its roofline time (the compute a reload from host memory can hide behind).
    ``unallocated``: backward ops whose tensors the compiler computes inside their readers' kernels
    (``fused_costs.unallocated_in_backward``); they allocate nothing, and the forward values they
    read are read by those readers, so those values stay alive until then."""
    ignored = _ignored_storages(ids, gradients)
    order = [node for node in graph.nodes if node in backward_nodes]
    last_use = _last_uses(order, unallocated)
    live: dict[StorageWeakRef, int] = {}
    steps: list[BackwardStep] = []
    carried = _carried_reads(order, ids, unallocated)
    for index, node in enumerate(order):
        for key, nbytes in () if node in unallocated else storages(node):
            if key not in ignored:
                live.setdefault(key, nbytes)
        if node.op == "call_function":
            reads = {ids[s] for s in node.all_input_nodes if s in ids}
            reads.update(i for s in node.all_input_nodes for i in carried.get(s, ()))
            extra = scratch.get(node, 0)
            steps.append(BackwardStep(tuple(sorted(reads)), sum(live.values()) + extra, _op_seconds(node, profile), extra))
        for key in [k for k in live if last_use.get(k, index) <= index]:
            del live[key]
    return tuple(steps)


def _ignored_storages(ids: dict[fx.Node, int], gradients: list[fx.Node | None]) -> set[StorageWeakRef]:
    """Storages no backward working set counts: forward values' (the plan's account) and the gradients returned."""
    forward_keys = {key for node in ids for key, _ in storages(node)}
    return forward_keys | {key for node in gradients if node is not None for key, _ in storages(node)}


def _last_uses(order: list[fx.Node], unallocated: frozenset[fx.Node]) -> dict[StorageWeakRef, int]:
    """The position of each backward storage's last reader (an unallocated reader's readers read it)."""
    position = {node: index for index, node in enumerate(order)}
    read_until = reads_happen_at(order, unallocated)
    last_use: dict[StorageWeakRef, int] = {}
    for node in order:
        end = max((read_until[u] for u in node.users if u in position), default=position[node])
        for key, _ in storages(node):
            last_use[key] = max(last_use.get(key, end), end)
    return last_use


def _carried_reads(order: list[fx.Node], ids: dict[fx.Node, int], unallocated: frozenset[fx.Node]) -> dict[fx.Node, set[int]]:
    """Forward values read through a backward node: through its views, and through a fused op,
    whose reads happen in its readers' kernels."""
    carried = _forward_values_viewed(order, ids)
    for node in order:
        if node in unallocated:
            carried.setdefault(node, set()).update(
                i for s in node.all_input_nodes for i in ({ids[s]} if s in ids else carried.get(s, ())))
    return carried


def reads_happen_at(order: list[fx.Node], unallocated: Collection[fx.Node]) -> dict[fx.Node, int]:
    """Where in ``order`` each node's reads of its inputs really happen: at its own position, or for
    an unallocated (fused) node, where the last of its readers' kernels runs (``rewrite.simulate``'s
    replay counts the same)."""
    position = {node: index for index, node in enumerate(order)}
    until: dict[fx.Node, int] = {}
    for node in reversed(order):
        if node in unallocated:
            until[node] = max((until[u] for u in node.users if u in position), default=position[node])
        else:
            until[node] = position[node]
    return until


def _op_seconds(node: fx.Node, profile: DeviceProfile) -> float:
    """Roofline time of one call; views and getitems move no data."""
    val = node.meta.get("val")
    if node.target is operator.getitem or not isinstance(val, torch.Tensor):
        return 0.0
    if any(isinstance(s.meta.get("val"), torch.Tensor) and same_storage(s.meta["val"], val)
           for s in node.all_input_nodes):
        return 0.0
    return profile.op_seconds(node_flops(node), bytes_moved(node), dtype_of(val))


def _forward_values_viewed(order: list[fx.Node], ids: dict[fx.Node, int]) -> dict[fx.Node, set[int]]:
    """For each backward node that is a view of forward values (``t(x)``, ``detach(y)`` traced in
    a backward formula), those values' ids: reading the view reads them, so their storages
    stay alive until the view's last reader, not the view's creation."""
    carried: dict[fx.Node, set[int]] = {}
    for node in order:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for source in node.all_input_nodes:
            source_val = source.meta.get("val")
            if isinstance(source_val, torch.Tensor) and same_storage(source_val, val):
                carried.setdefault(node, set()).update({ids[source]} if source in ids else carried.get(source, ()))
    return carried
