"""Checkpointing heuristics people use today, as planners with the ILP's signature.

Each names the values it wants to keep; ``closure_from_keep_set`` completes that into a
valid plan (what backward reads and is not kept is recomputed, back to kept or available
values). They ignore the budget, except to record it: the caller compares ``kept_bytes``.
Values that cannot be recomputed in effect (random ops, or anything hanging off one through
a tuple) are always added to the keep set, since no plan can do otherwise.
"""

from __future__ import annotations

import math
from typing import Iterable

import networkx as nx

from .analysis.graph_facts import effectively_recomputable, forced_keeps
from .problem import Plan, Problem, closure_from_keep_set
from .tags import Tag
from .registry import Decision, SolverFn, planner
from .status import Status


def _plan(problem: Problem, keep: Iterable[int]) -> Decision:
    kept, recomputed = closure_from_keep_set(problem, set(keep) | forced_keeps(problem))
    return Decision(kept=kept, recomputed=recomputed, status=Status.FEASIBLE, gap=None)


@planner("keep_all", exact=False, bounds=None,
         description="no rematerialization: keep every value backward reads")
def keep_all(problem: Problem, budget_bytes: int | None = None, **options: object) -> Decision:
    """No rematerialization: keep every value backward reads."""
    return _plan(problem, problem.backward_reads)


@planner("recompute_all", exact=False, bounds=None,
         description="keep only what cannot be recomputed, recompute the rest")
def recompute_all(problem: Problem, budget_bytes: int | None = None, **options: object) -> Decision:
    """Keep only what cannot be recomputed, recompute everything else.

    Not the fewest bytes: keeping a small recomputable value can spare a big one that cannot be
    recomputed (a dropout mask read only to recompute it). ``min_feasible_bytes`` is the minimum.
    """
    return _plan(problem, ())


def articulation_chain(problem: Problem) -> list[int]:
    """Non-available values every forward path passes through, in topological order.

    A virtual source feeds the values computed from available ones only, the forward outputs
    (or, when the problem names none, the values nobody reads) feed a virtual sink; the chain
    is the sink's dominators. On a transformer these are
    the residual stream between blocks, where Chen et al. put their segment boundaries.
    """
    values = problem.values
    graph = nx.DiGraph()
    source, sink = "source", "sink"
    graph.add_nodes_from((source, sink))
    users = problem.users
    for value in values:
        if value.available:
            continue
        inner = [u for u in value.inputs if not values[u].available]
        graph.add_edges_from((u, value.id) for u in inner)
        if not inner:
            graph.add_edge(source, value.id)
        # The forward's outputs end the chain; without them (hand-made problems), every value
        # nobody reads does. (Values only backward reads, such as dropout masks, would otherwise
        # bypass the residual stream and leave no articulation points at all.)
        ends = value.id in problem.forward_outputs if problem.forward_outputs else not any(
            not values[w].available for w in users[value.id])
        if ends:
            graph.add_edge(value.id, sink)
    if not graph.has_edge(source, sink) and not nx.has_path(graph, source, sink):
        return []
    dominators = nx.immediate_dominators(graph, source)
    chain: list[int] = []
    node = dominators[sink]
    while node != source:
        chain.append(node)
        node = dominators[node]
    return sorted(chain)


@planner("chen_sqrt", exact=False, bounds=None,
         description="Chen et al. 2016: sqrt(n)-block segments checkpointed at their inputs")
def chen_sqrt(problem: Problem, budget_bytes: int | None = None, **options: object) -> Decision:
    """Chen et al. 2016: segments of about sqrt(n) of the n layers, checkpointed at their inputs.

    On a model with repeated blocks (module paths with an index, ``block_of``) this is
    ``torch.utils.checkpoint.checkpoint_sequential`` with ceil(sqrt(n)) blocks a segment: each
    segment keeps its inputs, recomputes everything inside. Without blocks, every
    ceil(sqrt(m))-th of the m keepable articulation-chain values is kept (the chain is empty
    when side inputs such as masks reach every layer: then nothing but forced keeps).
    """
    blocks = [block_of(v.module) for v in problem.values]
    order = list(dict.fromkeys(b for b in blocks if b is not None))
    if len(order) >= 2:
        stride = max(1, math.ceil(math.sqrt(len(order))))
        segment = {block: f"segment{index // stride}" for index, block in enumerate(order)}
        return _plan(problem, _segment_inputs(problem, [segment.get(b) if b else None for b in blocks]))
    chain = [v for v in articulation_chain(problem) if problem.values[v].keepable]
    stride = max(1, math.ceil(math.sqrt(len(chain))))
    return _plan(problem, chain[stride - 1 :: stride])


def block_of(module: str) -> str | None:
    """The repeated block a module path belongs to: up to its first numeric part.

    >>> block_of("model.layers.12.mlp.fc"), block_of("lm_head")
    ('model.layers.12', None)
    """
    parts = module.split(".") if module else []
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return None


def _segment_inputs(problem: Problem, segments: list[str | None]) -> set[int]:
    """What ``torch.utils.checkpoint`` around each segment keeps (``segments[v]``: v's segment
    or None outside every segment).

    A checkpointed segment saves its tensor inputs and drops everything computed inside it;
    code outside the segments saves what autograd saves there: the values backward reads
    outside every segment, and a segment's output that outside code reads and backward needs
    (a final norm saving the last block's output).
    """
    values = problem.values
    keep = {v for v in problem.backward_reads if segments[v] is None}
    for value in values:
        mine = segments[value.id]
        for u in value.inputs:
            if segments[u] == mine:
                continue
            if mine is not None or u in problem.backward_reads:
                keep.add(u)
    return _instead_of_helpers(problem, keep)


def _backward_helpers(problem: Problem) -> set[int]:
    """Values the joint trace computes only for backward (``2 * x`` for ``pow(x, 2)``, ``rsqrt**3``).

    They read no tangent, so they count as forward values, but no forward output depends on
    them and they are not secondary outputs (``getitem``) of a forward op. Eager autograd never
    stores them: it saves their inputs and computes them in backward. Needs the problem's
    forward outputs to tell them apart (hand-made problems without them have none).
    """
    if not problem.forward_outputs:
        return set()
    values = problem.values
    needed = set(problem.forward_outputs)
    stack = list(needed)
    while stack:
        for u in values[stack.pop()].inputs:
            if u not in needed:
                needed.add(u)
                stack.append(u)
    return {
        v.id for v in values
        if v.id not in needed and not v.available and v.recomputable and Tag.VIEW not in v.tags and v.op != "getitem"
    }


def _instead_of_helpers(problem: Problem, keep: set[int]) -> set[int]:
    """Keep a backward helper's inputs rather than the helper, as eager autograd does."""
    helpers = _backward_helpers(problem)
    result = keep - helpers
    stack = [v for v in keep if v in helpers]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        for u in problem.values[v].inputs:
            if u in helpers and u not in seen:
                seen.add(u)
                stack.append(u)
            elif u not in helpers:
                result.add(u)
    return result


@planner("per_block", exact=False, bounds=None,
         description="torch.utils.checkpoint around each repeated block")
def per_block(problem: Problem, budget_bytes: int | None = None, **options: object) -> Decision:
    """torch.utils.checkpoint around each block: keep block inputs, recompute inside blocks.

    Outside the blocks, what backward reads is kept, as autograd would. Random ops inside a
    block are kept rather than replayed (dropout keeps its 1-byte mask, torch replays the RNG
    state): on models without dropout the plan keeps what torch's checkpointing saves
    (``tests/test_checkpoint_reference.py``).
    """
    return _plan(problem, _segment_inputs(problem, [block_of(v.module) for v in problem.values]))


@planner("selective", exact=False, bounds=None,
         description="Megatron's selective recompute of the attention core")
def selective(problem: Problem, budget_bytes: int | None = None, **options: object) -> Decision:
    """Megatron-style selective recompute: recompute the attention core, keep the rest."""
    recomputable = effectively_recomputable(problem)
    keep = {
        v.id for v in problem.values
        if not (Tag.ATTENTION_CORE in v.tags and recomputable[v.id])
    }
    return _plan(problem, keep)


BASELINES: dict[str, SolverFn] = {
    "keep_all": keep_all,
    "recompute_all": recompute_all,
    "chen_sqrt": chen_sqrt,
    "per_block": per_block,
    "selective": selective,
}


def heuristic_plans(problem: Problem) -> list[Plan]:
    """Every baseline's plan: candidate warm starts for the ILP."""
    return [planner(problem) for planner in BASELINES.values()]
