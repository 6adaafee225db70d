"""Emit a plan's offloads into the rewritten graphs, with PyTorch's own offload ops.

Each offloaded storage (``Plan.offloaded``; ``solvers.analysis.transfers`` says when its transfers run) is
saved for backward through its base tensor, the op that allocated it, and becomes four nodes:

* forward: ``host = ao.offload(base)`` right after ``base`` is made (the send starts as soon
  as the transfer stream is free), and ``host = ao.wait_tensor(host, keepalive=base)`` where
  the link model says the send has finished and after the storage's last forward reader: the
  wait frees the device bytes. The forward returns ``host`` in place of ``base``.
* backward: ``dev = ao.reload(host, device, size, stride)`` at the start of the backward step
  the link model picks (prefetched as late as still hides the fetch: the buffer holds device
  memory from then on), and ``dev = ao.wait_tensor(dev, keepalive=host)`` just before the
  first node that reads the storage. Views of the storage that backward reads are rebuilt
  from ``dev`` (view ops cost nothing).

The ops are ``torch.ops.ao.offload`` / ``ao.reload`` / ``ao.wait_tensor`` from
``torch._functorch._activation_offloading.offload_ops`` (torch 2.13+: one transfer stream per
device, completion events, a pinned-memory pool — this module adds no stream logic). They need
an accelerator. For tensors on the CPU this module emits a stand-in with the same signatures
(``remat_pass::offload_copy`` and friends: a copy; the source is not freed), so the
rewritten graphs run and their gradients can be checked against eager bit for bit on a
machine without a GPU; memory effects are then checked by the simulators, which count the
host copies as host memory.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from remat_pass.solvers.analysis.transfers import Transfer, storage_creators, transfer_schedule
from remat_pass.solvers.problem import Plan, Problem

from ..errors import RematError

logger = logging.getLogger(__name__)

HOST_META = "remat_offload"  # node.meta key: "host" on nodes whose tensor lives in host memory
_AO_MODULE = "torch._functorch._activation_offloading.offload_ops"


class OffloadUnavailableError(RematError, RuntimeError):
    """Offload was asked for where this torch (or this device) cannot do it."""


# --- the CPU stand-in ---------------------------------------------------------------------------

_stand_in = torch.library.Library("remat_pass", "DEF")
_stand_in.define("offload_copy(Tensor tensor) -> Tensor")
_stand_in.define("reload_copy(Tensor tensor, Device device, SymInt[]? original_size=None, "
                 "SymInt[]? original_stride=None) -> Tensor")
_stand_in.define("wait_copy(Tensor(a) tensor, Tensor? keepalive=None) -> Tensor(a)")


@torch.library.impl("remat_pass::offload_copy", "CompositeExplicitAutograd")
def _offload_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``ao.offload`` without a stream: a contiguous copy (the host buffer)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)


@torch.library.impl("remat_pass::reload_copy", "CompositeExplicitAutograd")
def _reload_copy(tensor: torch.Tensor, device: torch.device, original_size: list[int] | None = None,
                 original_stride: list[int] | None = None) -> torch.Tensor:
    """``ao.reload`` without a stream: a copy into the original layout."""
    size = original_size if original_size is not None else list(tensor.shape)
    stride = original_stride if original_stride is not None else list(tensor.stride())
    return torch.empty_strided(size, stride, dtype=tensor.dtype, device=device).copy_(tensor)


@torch.library.impl("remat_pass::wait_copy", "CompositeExplicitAutograd")
def _wait_copy(tensor: torch.Tensor, keepalive: torch.Tensor | None = None) -> torch.Tensor:
    """``ao.wait_tensor`` without a stream: nothing to wait for. Unlike it, the source is not
    freed here (``resize_(0)``): Inductor reuses buffers behind the graph's back, and on the CPU
    the copy saves nothing anyway; the simulators account for the freeing."""
    return tensor


@torch.library.register_fake("remat_pass::offload_copy")
def _offload_copy_fake(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


@torch.library.register_fake("remat_pass::reload_copy")
def _reload_copy_fake(tensor: torch.Tensor, device: torch.device, original_size: list[int] | None = None,
                      original_stride: list[int] | None = None) -> torch.Tensor:
    size = original_size if original_size is not None else list(tensor.shape)
    stride = original_stride if original_stride is not None else list(tensor.stride())
    return torch.empty_strided(size, stride, dtype=tensor.dtype, device=device)


@torch.library.register_fake("remat_pass::wait_copy")
def _wait_copy_fake(tensor: torch.Tensor, keepalive: torch.Tensor | None = None) -> torch.Tensor:
    return tensor


fx.node.has_side_effect(torch.ops.remat_pass.wait_copy.default)


def check_offload_options(offload: bool, device: Any, solver: str) -> None:
    """Reject ``offload=True`` where it cannot work (ValueError), before anything is traced."""
    if not offload or device == "auto":  # "auto": checked when planning, once the device is known
        return
    from remat_pass.solvers.offload_planner import require_offload

    from ..annotate.costs import get_profile

    profile = get_profile(device)
    require_offload(profile.name, profile.host_link_bytes_per_second, solver)


def parse_host_budget(host_budget: object) -> int | None:
    """``host_budget`` for the front doors: None (unlimited), bytes, or a size like "64GB"."""
    if host_budget is None:
        return None
    from ..planning.budget import parse_budget
    from ..errors import InvalidBudgetError

    parsed = parse_budget(host_budget)
    if parsed.nbytes is None:
        raise InvalidBudgetError(f"host_budget is a size in bytes (an int, or a string like '64GB'), got {host_budget!r}")
    return parsed.nbytes


# --- choosing the ops ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferOps:
    """The three ops a rewrite emits; ``kind`` is "ao" (PyTorch's) or "stand-in" (CPU copies)."""

    kind: str
    offload: Callable[..., Any]
    reload: Callable[..., Any]
    wait: Callable[..., Any]


def ao_ops_available() -> bool:
    """Whether this torch ships ``torch.ops.ao.offload`` / ``reload`` / ``wait_tensor``."""
    try:
        importlib.import_module(_AO_MODULE)  # registers the ops
    except ImportError:
        return False
    return all(hasattr(torch.ops.ao, name) for name in ("offload", "reload", "wait_tensor"))


def transfer_ops(device: torch.device) -> TransferOps:
    """PyTorch's offload ops for an accelerator; the stand-in for tensors on the CPU.

    Raises OffloadUnavailableError on an accelerator when this torch lacks the ops.
    """
    if device.type == "cpu":
        ops = torch.ops.remat_pass
        return TransferOps("stand-in", ops.offload_copy.default, ops.reload_copy.default, ops.wait_copy.default)
    if not ao_ops_available():
        raise OffloadUnavailableError(
            f"offload=True needs torch.ops.ao.offload / ao.reload / ao.wait_tensor ({_AO_MODULE}), which this "
            f"torch {torch.__version__} does not have (they ship with torch 2.13). Upgrade torch, or plan "
            f"without offload (offload=False)."
        )
    ops = torch.ops.ao
    return TransferOps("ao", ops.offload.default, ops.reload.default, ops.wait_tensor.default)


# --- the rewrite hooks --------------------------------------------------------------------------


def offloaded_storages(problem: Problem, plan: Plan) -> dict[int, int]:
    """Offloaded storage -> the value that allocates it (its base)."""
    creators = storage_creators(problem)
    return {s: creators[s] for s in sorted({problem.values[i].storage for i in plan.offloaded})}


def saved_bases(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> list[fx.Node]:
    """What the forward saves for the offloaded storages: each base once."""
    return [nodes[creator] for creator in offloaded_storages(problem, plan).values()]


def rebuilt_views(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> set[str]:
    """Names of the other values of offloaded storages: views backward rebuilds from the base."""
    bases = offloaded_storages(problem, plan)
    return {nodes[v.id].name for v in problem.values if v.storage in bases and v.id != bases[v.storage]}


def emit(forward: fx.GraphModule, backward: fx.GraphModule, problem: Problem, plan: Plan, nodes: list[fx.Node],
         backward_step_names: list[str]) -> None:
    """Insert the transfers of ``plan`` into the split graphs (see the module doc)."""
    if not plan.offloaded:
        return
    schedule = transfer_schedule(problem, plan)
    index_of = {node.name: i for i, node in enumerate(nodes)}
    # Fetches are issued in the order backward needs them: the transfer stream runs them in issue order.
    for transfer in sorted(schedule.transfers, key=lambda t: (t.reload_step, t.need_event, t.storage)):
        base = nodes[transfer.creator]
        value = base.meta.get("val")
        if not isinstance(value, torch.Tensor) or any(not isinstance(d, int) for d in (*value.shape, *value.stride())):
            raise RematError(f"cannot offload {base.name}: offload needs a tensor of static shape "
                             f"({base.format_node()})")
        ops = transfer_ops(value.device)
        host = _emit_send(forward.graph, base.name, transfer, ops, index_of)
        _emit_fetch(backward.graph, base.name, transfer, ops, host, backward_step_names)
    logger.info("offload: %d storages (%d bytes) sent to host memory, predicted exposed transfer %.3g ms (%s ops)",
                len(schedule.transfers), plan.offloaded_bytes, schedule.exposed_seconds * 1e3, ops.kind)


def _node_named(graph: fx.Graph, name: str, what: str) -> fx.Node:
    for node in graph.nodes:
        if node.name == name:
            return node
    raise RematError(f"internal error: the {what} graph has no node {name!r} to offload")


def _host_value(value: torch.Tensor) -> torch.Tensor:
    with _fake_mode_of(value):
        return torch.empty(value.shape, dtype=value.dtype, device="cpu")


def _fake_mode_of(value: torch.Tensor) -> Any:
    import contextlib

    mode = getattr(value, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def _emit_send(graph: fx.Graph, name: str, transfer: Transfer, ops: TransferOps,
               index_of: dict[str, int]) -> torch.Tensor:
    """``offload`` after the base, its wait where the send is done; the forward returns the host copy."""
    base = _node_named(graph, name, "forward")
    value = base.meta["val"]
    with graph.inserting_after(base):
        send = graph.call_function(ops.offload, (base,))
    host = _host_value(value)
    send.meta.update(val=host, **{HOST_META: "host"})
    output = next(iter(graph.find_nodes(op="output")))
    order = list(graph.nodes)
    position = {node: i for i, node in enumerate(order)}
    after = next((n for n in order if index_of.get(n.name, -1) > transfer.wait_after and n.op != "placeholder"),
                 output)
    readers = [u for u in base.users if u is not send and u.op != "output"]
    last_reader = max(readers, key=position.__getitem__, default=send)
    if position[after] <= position[last_reader]:
        after = last_reader.next
    with graph.inserting_before(after):
        done = graph.call_function(ops.wait, (send, base))
    done.meta.update(val=host, **{HOST_META: "host"})
    outputs = list(output.args[0])
    outputs = [done if item is base else item for item in outputs]
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    return host


def _emit_fetch(graph: fx.Graph, name: str, transfer: Transfer, ops: TransferOps, host: torch.Tensor,
                step_names: list[str]) -> None:
    """``reload`` at the start of the chosen backward step, its wait before the first reader."""
    saved = _node_named(graph, name, "backward")
    device_value = saved.meta["val"]
    saved.meta.update(val=host, **{HOST_META: "host"})
    readers = list(saved.users)
    if not readers:
        raise RematError(f"internal error: offloaded {name} has no reader in backward")
    order = list(graph.nodes)
    position = {node: i for i, node in enumerate(order)}
    first_reader = min(readers, key=position.__getitem__)
    issue = _step_start(order, step_names, transfer.reload_step)
    if issue is None or position[issue] > position[first_reader]:
        issue = first_reader
    size, stride = list(device_value.shape), list(device_value.stride())
    with graph.inserting_before(issue):
        fetch = graph.call_function(ops.reload, (saved, device_value.device, size, stride))
    fetch.meta["val"] = device_value
    with graph.inserting_before(first_reader):
        ready = graph.call_function(ops.wait, (fetch, saved))
    ready.meta["val"] = device_value
    for reader in readers:
        reader.replace_input_with(saved, ready)


def _step_start(order: list[fx.Node], step_names: list[str], step: int) -> fx.Node | None:
    """The first node of backward step ``step``: right after the op of the step before it."""
    if step == 0:
        return next((n for n in order if n.op != "placeholder"), None)
    wanted = set(step_names[:step])
    last = None
    for node in order:
        if node.name in wanted:
            last = node
    return last.next if last is not None else None


def backward_step_names(joint_graph: fx.Graph) -> list[str]:
    """Names of the joint graph's backward ops in order: ``Problem.backward_steps`` by name
    (annotate's own record of which nodes are backward, ``node.meta["remat"].phase``)."""
    from ..annotate.annotate import BACKWARD, META_KEY

    return [n.name for n in joint_graph.nodes
            if n.op == "call_function" and getattr(n.meta.get(META_KEY), "phase", None) == BACKWARD]
