"""Under Inductor, recompute what Inductor recomputes for free instead of keeping it.

The planners price the unfused, op-by-op program: there a kept value costs its bytes and a
recomputed one a kernel. Inductor's program differs for one class of values: a view, or a
pointwise value with no FLOPs, made (directly or through a chain of such values) only from
values alive anyway (parameters, buffers, the step's inputs). Recomputed, it is fused into the
kernel of its backward reader and costs nothing; kept, it is written out by the forward in a
pass of its own and saved as a tensor of its own (benchmarks/VS_INDUCTOR.md, "step overhead":
the causal mask's ``bitwise_not`` kept, 0.034 ms against 0.003 ms for torch's fused kernel, and
ten saved transposes of weights). Torch's own partitioner recomputes these; so does this pass.

Two limits keep the move safe:

- a pointwise value whose backward readers include an extern kernel (a matmul, an attention:
  any op with FLOPs, seen through views) stays kept: Inductor cannot fuse its recompute into
  that reader, so it would be a separate kernel in backward;
- the move must not raise the unfused program's simulated peak (the memory model the budget
  and ``reconcile``'s check read): moving a value from kept to recomputed only shortens its
  life, but the chain it is recomputed from lives for a moment in backward, so each move is
  checked, and one that raises the peak is not made.

The pass only moves values from ``kept`` to ``recomputed``: the plan says what it recomputes.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from torch import fx

from remat_pass import solvers
from remat_pass.solvers.problem import Plan, Problem
from remat_pass.solvers.tags import Tag

from ..compat import is_view_op
from ..annotate.annotate import BACKWARD, META_KEY, AnnotatedGraph
from ..annotate.fused_costs import is_cheap_op

logger = logging.getLogger(__name__)


def free_values(annotated: AnnotatedGraph) -> frozenset[int]:
    """Values Inductor would recompute for free: cheap ops (``is_cheap_op``) whose inputs are
    each available or such a value, transitively."""
    values = annotated.problem.values
    free: set[int] = set()
    for value, node in zip(values, annotated.nodes):
        if value.available or not is_cheap_op(node, value):
            continue
        if all(values[i].available or i in free for i in value.inputs):
            free.add(value.id)
    return frozenset(free)


def _runs_in_backward(user: fx.Node, plan: Plan) -> bool:
    """A backward node, or a forward one the plan recomputes (it runs in backward too)."""
    info = user.meta.get(META_KEY)
    if info is None:
        return False
    return info.phase == BACKWARD or info.value_id in plan.recomputed


def _backward_consumers(node: fx.Node, plan: Plan) -> list[fx.Node]:
    """The nodes that read ``node``'s data in backward, seen through views (a view is no kernel)."""
    found: list[fx.Node] = []
    for user in node.users:
        if not _runs_in_backward(user, plan):
            continue
        if is_view_op(user):
            found.extend(_backward_consumers(user, plan))
        else:
            found.append(user)
    return found


def _only_views(annotated: AnnotatedGraph, value_id: int) -> bool:
    """A view of views of available values (a weight's transpose, a slice of a buffer): no kernel."""
    values = annotated.problem.values
    value = values[value_id]
    return Tag.VIEW in value.tags and all(values[i].available or _only_views(annotated, i) for i in value.inputs)


def fuses_into_backward(annotated: AnnotatedGraph, plan: Plan, value_id: int) -> bool:
    """Whether recomputing the value costs no kernel of its own in Inductor's backward: views of
    available values only, or no reader in backward is an extern kernel (an op with FLOPs: a
    matmul, a convolution, an attention), into which Inductor cannot fuse the recompute."""
    if _only_views(annotated, value_id):
        return True
    consumers = _backward_consumers(annotated.nodes[value_id], plan)
    return all(not getattr(user.meta.get(META_KEY), "flops", 0) for user in consumers)


def _recomputed_with(problem: Problem, plan: Plan, kept: frozenset[int], moved: frozenset[int]) -> frozenset[int]:
    """``moved`` and the chain each is recomputed from (its inputs neither kept nor had)."""
    have = kept | plan.offloaded | plan.recomputed
    chain: set[int] = set()
    stack = list(moved)
    while stack:
        index = stack.pop()
        if index in chain:
            continue
        chain.add(index)
        stack.extend(i for i in problem.values[index].inputs
                     if not problem.values[i].available and i not in have)
    return frozenset(chain)


def _moved(problem: Problem, plan: Plan, moved: frozenset[int]) -> Plan | None:
    """``plan`` with ``moved`` recomputed, its simulated peak set; None where no valid plan does
    it (a storage shared with a refreshed value must be refreshed whole: ``Plan.check``)."""
    kept = plan.kept - moved
    added = _recomputed_with(problem, plan, kept, moved)
    try:
        trial = replace(plan, kept=kept, recomputed=plan.recomputed | added, fused=plan.fused | added)
    except ValueError:
        return None
    return replace(trial, predicted_peak_bytes=solvers.simulate_plan(problem, trial).peak_bytes)


def _fits(plan: Plan | None, peak: int) -> bool:
    return plan is not None and plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= peak


def recompute_fused_free(annotated: AnnotatedGraph, plan: Plan) -> Plan:
    """``plan`` with every kept free value (``free_values``) that fuses into its backward readers
    recomputed instead, each move only where the unfused peak does not rise."""
    problem = annotated.problem
    free = free_values(annotated)
    candidates = sorted(i for i in plan.kept & free
                        if i not in problem.forward_outputs and fuses_into_backward(annotated, plan, i))
    if not candidates:
        return plan
    peak = solvers.simulate_plan(problem, plan).peak_bytes
    moved = _moved(problem, plan, frozenset(candidates))
    if not _fits(moved, peak):
        moved = plan  # all at once raises the peak: one at a time, each kept only if it does not
        for index in candidates:
            trial = _moved(problem, moved, frozenset({index}))
            if _fits(trial, peak):
                moved = trial
    assert moved is not None
    if moved is plan:
        return plan
    names = sorted(problem.values[i].name for i in plan.kept - moved.kept)
    logger.info("inductor: recomputing %d kept value(s) Inductor fuses for free (%s%s); peak %d -> %s bytes",
                len(names), ", ".join(names[:8]), ", ..." if len(names) > 8 else "", peak,
                moved.predicted_peak_bytes)
    return moved


__all__ = ["free_values", "fuses_into_backward", "is_cheap_op", "recompute_fused_free"]
