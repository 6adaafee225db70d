"""The model as given: what the user's step holds for backward today, as a ``Plan``.

remat_pass promises never to hold more than the step the user already runs. Without
checkpointing, that step is the keep-all plan of the captured graph (annotate puts the
tangent-free parts of backward formulas in backward, as eager autograd does, so keep-all holds
no more than eager). A model that already checkpoints (``torch.utils.checkpoint`` regions,
Hugging Face's ``gradient_checkpointing_enable()``, selective activation checkpointing)
recomputes its regions in backward: AOTAutograd marks each region node with a
``CheckpointPolicy`` in ``node.meta["recompute"]``, annotate turns the recompute policies into
the ``Tag.CHECKPOINTED`` tag (``solvers.tags``; PREFER_/MUST_RECOMPUTE), and ``as_given_plan`` reads them back as recompute decisions.

That plan is the reference a fractional budget is relative to, and a cap on every budget:
the planner is asked for the cheapest plan within it, which is never worse than the as-given
plan (the as-given plan is one of the candidates).

Nothing here imports torch.
"""

from __future__ import annotations

import logging

from remat_pass.solvers.problem import Plan, Problem
from remat_pass.solvers.tags import Tag

logger = logging.getLogger(__name__)

AS_GIVEN = "as_given"


def has_checkpoint_regions(problem: Problem) -> bool:
    """Whether the model recomputes anything itself (else the as-given plan is keep-all)."""
    return any(Tag.CHECKPOINTED in value.tags for value in problem.values)


def as_given_plan(problem: Problem) -> Plan:
    """The model's own keep/recompute decisions: checkpointed values are recomputed, what they
    and backward read from outside their regions is kept.

    Walks the values latest first, so every reader of a value is decided before the value is.
    A checkpointed value that cannot be recomputed without changing results (a random op: eager
    checkpointing replays the RNG, remat_pass does not) is kept instead, so with dropout inside
    a region this plan, and so the reference, holds a little more than eager does.
    """
    rebuildable = _rebuildable(problem)
    needed = set(problem.backward_reads)
    kept: set[int] = set()
    recomputed: set[int] = set()
    for value in reversed(problem.values):
        if value.id not in needed or value.available:
            continue
        checkpointed = Tag.CHECKPOINTED in value.tags and rebuildable[value.id]
        if checkpointed or not value.keepable:
            recomputed.add(value.id)
            needed.update(value.inputs)
        else:
            kept.add(value.id)
    plan = Plan(problem, frozenset(kept), frozenset(recomputed), solver=AS_GIVEN, status="feasible", gap=None)
    if recomputed:
        logger.info("the model as given recomputes %d values and keeps %d of %d keep-all bytes",
                    len(recomputed), plan.kept_bytes, problem.keep_all_bytes())
    return plan


def _rebuildable(problem: Problem) -> list[bool]:
    """Whether each value could be recomputed in backward from values backward can have
    (a dropout output on CUDA reads its random op's tuple, which is neither kept nor redone)."""
    obtainable: list[bool] = []
    rebuildable: list[bool] = []
    for value in problem.values:
        rebuild = value.recomputable and all(obtainable[i] for i in value.inputs)
        rebuildable.append(rebuild)
        obtainable.append(value.available or value.keepable or rebuild)
    return rebuildable


__all__ = ["AS_GIVEN", "as_given_plan", "has_checkpoint_regions"]
