"""Kept views made again in backward from their kept base: one saved tensor per storage.

A storage counts once however many of its values a plan keeps (a view has no bytes of its own), so
plans keep a tensor and views of it: HF BERT's attention output and the (batch*seq, hidden) view of
it that the output projection reads. Saving both gives the forward two saved tensors that share a
storage, which AOTAutograd's donated buffers are not made for: under Inductor that compile then
donates nothing (``capture.donated_buffers``), 9% more measured peak on a 2-layer HF BERT.
A view costs no memory and no kernel, so backward makes each such view again from the saved base,
just before it reads it, and the forward saves the base alone. The plan itself (what is kept, what
its memory is) does not change.
"""

from __future__ import annotations

from torch import fx

from remat_pass.solvers.problem import Plan, Problem

from ..compat import is_view_op


def views_of_kept_values(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> frozenset[int]:
    """Ids of the values backward makes again by view ops from a kept value: each kept value that is a
    chain of view ops from another kept value, and the views on that chain. ``nodes`` are the
    problem's values' nodes, in graph order. Offloaded storages are left to ``rewrite.offload``."""
    offloaded = {problem.values[i].storage for i in plan.offloaded}
    index = {node: i for i, node in enumerate(nodes)}
    viewed_from: dict[int, int] = {}  # a view -> the kept value, or the view of one, it was made from
    for i, node in enumerate(nodes):
        if node.op != "call_function" or not is_view_op(node) or not node.args:
            continue
        source = index.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        storage = problem.values[i].storage
        if source is not None and (source in plan.kept or source in viewed_from) and \
                problem.values[source].storage == storage and storage not in offloaded:
            viewed_from[i] = source
    rebuilt: set[int] = set()
    for view in viewed_from:
        if view in plan.kept:
            while view in viewed_from and view not in rebuilt:  # up to the kept value that is no such view
                rebuilt.add(view)
                view = viewed_from[view]
    return frozenset(rebuilt)


__all__ = ["views_of_kept_values"]
