"""The graph-level memory replay: the live-bytes timeline of one training step from its two graphs.

This is the independent check of the plan-level model (``solvers.analysis.memory.simulate_plan``,
``PlanMemory``), which the planners use: the pipeline replays every rewritten pair of graphs
here and re-plans where the two disagree. The third account, what the allocator really did,
is measured by ``remat_pass.runtime.measure.allocator_peak``.

Given the forward and backward GraphModules of a step (ours, or any partitioner's), replay
them node by node as the eager FX runtime executes them: a node allocates the storages of
its outputs (a view allocates nothing: it shares its base's storage), and a storage is freed
after the last node that reads any alias of it — FX code drops each value after its last use,
and the boxed backward drops each saved tensor after its last use too. Forward outputs that
backward reads stay alive from the forward into the backward; the user's outputs stay alive
for the whole step.

Tensors an offload sends to host memory (nodes marked ``meta["remat_offload"] == "host"`` by
``remat_pass.rewrite.offload``) are not device memory and are not counted; the device tensor they were
sent from is freed at its wait (its last reader), the fetched copy counts from its reload on.

What is counted is activation memory: parameters, buffers and inputs (the forward graph's
placeholders, and views of them) are not, and neither are the parameter gradients the
backward returns (reported apart as ``gradient_bytes``). Scratch space inside a kernel is
counted while its node runs where annotate recorded it (``node.meta["remat"].scratch_bytes``,
measured per op configuration by ``remat_pass.annotate.scratch``), so a graph remat_pass did not annotate
shows none. A backward tensor annotate found Inductor computes inside its readers' kernels
(``meta["remat"].unallocated``, ``annotate.fused_costs``) allocates nothing, and what it reads is
read until those readers run. Sizes come from the fake values AOTAutograd traced
(``node.meta["val"]``), so the same simulator works for graphs traced on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from ..annotate.annotate import META_KEY
from ..annotate.backward_steps import reads_happen_at
from ..compat import concrete_int

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class MemoryEvent:
    """Live activation bytes right after ``node`` ran (its outputs allocated, before frees)."""

    index: int
    phase: str
    node: str
    live_bytes: int


@dataclass(frozen=True)
class GraphMemory:
    """The replayed step: every event, the peak, and where it happened."""

    events: tuple[MemoryEvent, ...]
    peak_bytes: int
    peak_node: str
    peak_phase: str
    saved_bytes: int
    gradient_bytes: int

    def series(self) -> list[tuple[int, int]]:
        """(event index, live bytes) pairs, for plotting."""
        return [(event.index, event.live_bytes) for event in self.events]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _storages_of(node: fx.Node) -> list[tuple[StorageWeakRef, int]]:
    if node.meta.get("remat_offload") == "host":
        return []  # host memory (an offloaded copy), not the device's
    found = []
    for tensor in _tensors(node.meta.get("val")):
        key = _storage(tensor)
        if key is not None:
            found.append((key, concrete_int(tensor.untyped_storage().nbytes())))
    return found


def _output_nodes(graph: fx.Graph) -> list[fx.Node]:
    output = next(iter(graph.find_nodes(op="output")))
    return [a for a in tree_flatten(output.args[0])[0] if isinstance(a, fx.Node)]


class _Replay:
    """Walks graphs in order, allocating and freeing storages; tracks the running total."""

    def __init__(self, excluded: set[StorageWeakRef]) -> None:
        self.excluded = excluded
        self.live: dict[StorageWeakRef, int] = {}
        self.events: list[MemoryEvent] = []

    @property
    def total(self) -> int:
        return sum(self.live.values())

    def allocate(self, node: fx.Node) -> None:
        for key, nbytes in _storages_of(node):
            if key not in self.excluded and key not in self.live:
                self.live[key] = nbytes

    def free(self, keys: Iterable[StorageWeakRef]) -> None:
        for key in keys:
            self.live.pop(key, None)

    def record(self, phase: str, node: fx.Node) -> None:
        scratch = getattr(node.meta.get(META_KEY), "scratch_bytes", 0)
        self.events.append(MemoryEvent(len(self.events), phase, node.name, self.total + scratch))

    def run(self, graph: fx.Graph, phase: str, pinned: set[StorageWeakRef]) -> None:
        """Execute ``graph``'s nodes; storages in ``pinned`` outlive the graph."""
        nodes = list(graph.nodes)
        fused = {node for node in nodes if getattr(node.meta.get(META_KEY), "unallocated", False)}
        last_use = _storage_last_use(nodes, fused)
        frees: dict[int, list[StorageWeakRef]] = {}
        for key, index in last_use.items():
            if key not in pinned:
                frees.setdefault(index, []).append(key)
        for index, node in enumerate(nodes):
            if node.op == "output":
                continue
            if node.op != "placeholder":
                if node not in fused:  # computed inside its readers' kernels: nothing allocated
                    self.allocate(node)
                self.record(phase, node)
            self.free(frees.get(index, ()))


def _storage_last_use(nodes: list[fx.Node], fused: set[fx.Node]) -> dict[StorageWeakRef, int]:
    """Index of the last node that reads (or, unread, produces) each storage; a ``fused`` node
    reads its inputs where its own last reader runs."""
    position = {node: index for index, node in enumerate(nodes)}
    read_at = reads_happen_at(nodes, fused)
    last: dict[StorageWeakRef, int] = {}
    for node in nodes:
        if node.op == "output":
            continue
        end = max([read_at[user] for user in node.users if user.op != "output"], default=position[node])
        for key, _ in _storages_of(node):
            last[key] = max(last.get(key, end), end)
    return last


def simulate(forward: fx.GraphModule, backward: fx.GraphModule) -> GraphMemory:
    """The live activation bytes over forward then backward, and the peak.

    >>> # forward, backward = remat_pass.rewrite.rewrite.rewrite(annotated, plan)
    >>> # simulate(forward, backward).peak_bytes
    """
    inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    excluded = {key for node in inputs for key, _ in _storages_of(node)}
    saved_names = {n.name for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
    forward_outputs = _output_nodes(forward.graph)
    pinned_forward = {key for node in forward_outputs for key, _ in _storages_of(node)}
    user_outputs = [n for n in forward_outputs if n.name not in saved_names]
    user_keys = {key for node in user_outputs for key, _ in _storages_of(node)}

    replay = _Replay(excluded)
    replay.run(forward.graph, FORWARD, pinned_forward)
    saved = {key: nbytes for node in forward_outputs if node.name in saved_names for key, nbytes in _storages_of(node)}
    saved_bytes = sum(nbytes for key, nbytes in saved.items() if key not in excluded)
    # Forward outputs nobody reads later (neither user nor backward) would be dropped here.
    gradients = {key for node in _output_nodes(backward.graph) for key, _ in _storages_of(node)} - excluded
    for node in backward.graph.find_nodes(op="placeholder"):
        if node.name.startswith("tangents"):
            replay.allocate(node)
    replay.excluded = replay.excluded | gradients  # parameter gradients are counted apart
    replay.run(backward.graph, BACKWARD, user_keys | gradients)
    gradient_sizes = {key: nbytes for node in _output_nodes(backward.graph) for key, nbytes in _storages_of(node)}
    gradient_bytes = sum(nbytes for key, nbytes in gradient_sizes.items() if key in gradients)
    peak = max(replay.events, key=lambda event: event.live_bytes, default=MemoryEvent(0, FORWARD, "", 0))
    return GraphMemory(
        events=tuple(replay.events),
        peak_bytes=peak.live_bytes,
        peak_node=peak.node,
        peak_phase=peak.phase,
        saved_bytes=saved_bytes,
        gradient_bytes=gradient_bytes,
    )
