"""Kept views made again in backward from their kept base: one saved tensor per storage.

A storage counts once however many of its values a plan keeps (a view has no bytes of its own), so
plans keep a tensor and views of it: HF BERT's attention output and the (batch*seq, hidden) view of
it that the output projection reads. Saving both gives the forward two saved tensors that share a
storage, which AOTAutograd's donated buffers are not made for: under Inductor that compile then
donates nothing (``capture.donated_buffers``), 9% more measured peak on a 2-layer HF BERT.
A view costs no memory and no kernel, so backward makes each such view again from the saved base,
just before it reads it, and the forward saves the base alone; where the plan keeps two or more views
of a value it does not keep (HF OLMo2's rotary tables), the forward saves that value instead (the same
storage). The plan itself (what is kept, what its memory is) does not change.
"""

from __future__ import annotations

from torch import fx

from remat_pass.solvers.problem import Plan, Problem

from ..compat import is_view_op


def saved_bases(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> frozenset[int]:
    """Values the plan neither keeps nor recomputes whose storage it keeps through two or more views of
    them (HF OLMo2's rotary tables: each layer's ``unsqueeze`` for q and for k): the forward saves the
    value itself instead (the same storage, no byte more) and backward makes the views again."""
    sources = _view_sources(problem, plan, nodes)
    views_by_root: dict[int, set[int]] = {}
    for view in plan.kept & sources.keys():
        views_by_root.setdefault(_root(view, sources), set()).add(view)
    return frozenset(root for root, views in views_by_root.items() if len(views) >= 2 and nodes[root].op == "call_function"
                     and root not in plan.kept and root not in plan.recomputed)


def views_of_kept_values(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> frozenset[int]:
    """Ids of the values backward makes again by view ops: each kept value that is a chain of view ops from
    another kept value or from one of ``saved_bases``, and the views on that chain (from the topmost such
    value). ``nodes`` are the problem's values' nodes, in graph order. Offloaded storages are left to
    ``rewrite.offload``."""
    sources = _view_sources(problem, plan, nodes)
    anchors = plan.kept | saved_bases(problem, plan, nodes)
    rebuilt: set[int] = set()
    for view in plan.kept & sources.keys():
        chain = [view]
        while chain[-1] in sources:
            chain.append(sources[chain[-1]])
        tops = [position for position, value in enumerate(chain) if position > 0 and value in anchors]
        if tops:
            rebuilt.update(chain[: tops[-1]])
    return frozenset(rebuilt)


def _view_sources(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> dict[int, int]:
    """Each value a view op makes -> the value it views, where both share a storage that is not offloaded."""
    offloaded = {problem.values[i].storage for i in plan.offloaded}
    index = {node: i for i, node in enumerate(nodes)}
    sources: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "call_function" or not is_view_op(node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        source, storage = index.get(node.args[0]), problem.values[i].storage
        if source is not None and problem.values[source].storage == storage and storage not in offloaded:
            sources[i] = source
    return sources


def _root(value: int, sources: dict[int, int]) -> int:
    while value in sources:
        value = sources[value]
    return value


__all__ = ["saved_bases", "views_of_kept_values"]
