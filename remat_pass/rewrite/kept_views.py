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

from dataclasses import dataclass

from torch import fx

from remat_pass.solvers.problem import Plan, Problem

from ..compat import is_view_op


@dataclass(frozen=True)
class ViewsMadeAgain:
    """What the rewrite saves and makes again instead of saving views that share a storage."""

    views: frozenset[int]  # kept values (and the views between them and their base) made again in backward
    bases: frozenset[int]  # values the plan neither keeps nor recomputes, saved for two or more kept views


def views_made_again(problem: Problem, plan: Plan, nodes: list[fx.Node]) -> ViewsMadeAgain:
    """Each kept value that is a chain of view ops from another kept value, or from a value the plan neither
    keeps nor recomputes but keeps two or more views of (HF OLMo2's rotary tables: each layer's ``unsqueeze``
    for q and for k; that value is then saved, the same storage, no byte more), is made again in backward
    with the views on its chain, from the topmost such value. ``nodes`` are the problem's values' nodes, in
    graph order. Offloaded storages are left to ``rewrite.offload``."""
    sources = _view_sources(problem, plan, nodes)
    chains = {view: _chain(view, sources) for view in plan.kept & sources.keys()}  # the view first, its root last
    views_by_root: dict[int, set[int]] = {}
    for view, chain in chains.items():
        views_by_root.setdefault(chain[-1], set()).add(view)
    bases = frozenset(root for root, views in views_by_root.items() if len(views) >= 2 and nodes[root].op == "call_function"
                      and root not in plan.kept and root not in plan.recomputed)
    anchors = plan.kept | bases
    rebuilt: set[int] = set()
    for chain in chains.values():
        tops = [position for position, value in enumerate(chain) if position > 0 and value in anchors]
        if tops:
            rebuilt.update(chain[: tops[-1]])
    return ViewsMadeAgain(frozenset(rebuilt), bases)


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


def _chain(value: int, sources: dict[int, int]) -> list[int]:
    """``value``, the value it views, and so on up to one that is no view of another."""
    chain = [value]
    while chain[-1] in sources:
        chain.append(sources[chain[-1]])
    return chain


__all__ = ["ViewsMadeAgain", "views_made_again"]
