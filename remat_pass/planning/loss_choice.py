"""Whether to chunk a step's loss (``chunk_loss=None``): one rule, for every front door.

The training backend (``runtime.dynamo_backend``) and ``plan``/``explain`` (``plan_model``) make
the same choice, so that ``plan`` says what ``optimize`` does; they differ only in how they try
a candidate (the backend rewrites Dynamo's graph and compiles it; ``plan`` traces the step
again), which they pass in as ``attempt``.

The rule, for a budget the user gave:
* plan the loss whole first; a step that fits without recompute is never changed;
* when the budget cannot be met whole, chunk the loss with its gradients computed in forward
  (``LossGradients.IN_FORWARD``: no extra FLOPs) and, if that still does not fit or fits only by
  recomputing the loss op itself, recomputed in backward (``RECOMPUTED``: one more head matmul,
  the lowest peak, nothing held from forward to backward);
* when it is met whole only with recompute, plan the chunked loss at the same budget too and
  keep whichever does less work: its recompute plus chunking's extra head matmul (0 in forward)
  against the whole loss's recompute (``worth_chunking``).
A chunked loss's budget is pinned to the bytes it meant for the step as written (``Pin``): a
fraction is of the user's step, not of the rewritten one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from ..capture.loss_chunking import ChunkLoss, LossGradients, chunk_for_budget, worth_chunking
from .pipeline import PlanOptions, pinned_budget

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Pin:
    """A budget fixed in bytes of a kind: what the user's budget meant for the step as written."""

    budget_bytes: int
    kind: str

    def applied_to(self, options: PlanOptions) -> PlanOptions:
        return pinned_budget(options, self.budget_bytes, self.kind)


# attempt(chunking, pin): the step planned with the loss whole (None, None) or chunked, the budget
# pinned; None when that chunking would leave the loss in one chunk (it lowers no peak and adds
# the op's working set). Raises BudgetInfeasibleError when the plan does not fit.
Attempt = Callable[[Optional[ChunkLoss], Optional[Pin]], Optional[T]]


def choose_loss(attempt: Attempt[T], plan_of: Callable[[T], Plan], extra_flops: Callable[[T], int],
                discard: Callable[[T], None] = lambda _: None) -> T:
    """The whole or the chunked loss's attempt, by the rule above. ``plan_of`` reads an attempt's
    plan, ``extra_flops`` what its chunking adds (0 for the loss whole), and ``discard`` drops
    the attempt not chosen. Raises the lowest-peak BudgetInfeasibleError when nothing fits."""
    cost = _Cost(plan_of, extra_flops)
    try:
        whole = attempt(None, None)
    except solvers.BudgetInfeasibleError as error:
        chunked = _chunked(attempt, cost, discard, Pin(error.budget_bytes, error.kind), error)
        if chunked is None:
            raise
        logger.info("the budget cannot be met with the loss whole (%s); planned with the loss chunked", error)
        return chunked
    assert whole is not None, "the loss whole is always an attempt"
    plan = plan_of(whole)
    if plan.budget_bytes is None or not plan.recompute_flops:
        return whole
    try:
        chunked = _chunked(attempt, cost, discard, Pin(plan.budget_bytes, plan.budget_kind), None)
    except solvers.BudgetInfeasibleError:
        return whole
    if chunked is None:
        return whole
    chunked_flops, extra = plan_of(chunked).recompute_flops, extra_flops(chunked)
    keep_chunked = worth_chunking(plan.recompute_flops, chunked_flops, extra)
    logger.info("loss whole: %d recompute FLOPs; chunked: %d + %d for the head: keeping the %s loss",
                plan.recompute_flops, chunked_flops, extra, "chunked" if keep_chunked else "whole")
    discard(whole if keep_chunked else chunked)
    return chunked if keep_chunked else whole


@dataclass(frozen=True)
class _Cost:
    """What an attempt adds to the step: its plan's recompute plus its chunking's extra FLOPs."""

    plan_of: Callable[[Any], Plan]
    extra_flops: Callable[[Any], int]

    def __call__(self, made: Any) -> int:
        return self.plan_of(made).recompute_flops + self.extra_flops(made)


def _chunked(attempt: Attempt[T], cost: _Cost, discard: Callable[[T], None], pin: Pin,
             whole_error: solvers.BudgetInfeasibleError | None) -> T | None:
    """The loss chunked with its gradients in forward; recomputed instead when that does not
    fit, or fits only by recomputing the loss op itself (its gradients then cost the head's
    matmuls twice over: recomputing the logits alone is cheaper), the cheaper of the two kept.
    None when chunking would not split the loss. Raises the error of the lowest peak found (the
    whole loss's included) when neither fits."""
    errors = [] if whole_error is None else [whole_error]
    best: T | None = None
    for gradients in LossGradients:
        try:
            made = attempt(chunk_for_budget(pin.budget_bytes, gradients), pin)
        except solvers.BudgetInfeasibleError as error:
            errors.append(error)
            continue
        if made is None:  # the loss would be one chunk
            return best
        if best is not None and cost(best) <= cost(made):
            discard(made)
        else:
            if best is not None:
                discard(best)
            best = made
        if not _recomputes_the_loss(cost.plan_of(made)):
            break
    if best is None:
        raise min(errors, key=lambda error: error.min_bytes)
    return best


def _recomputes_the_loss(plan: Plan) -> bool:
    """Whether ``plan`` runs the chunked loss op again in backward."""
    return any(plan.problem.values[i].op.startswith("chunked_linear_cross_entropy") for i in plan.recomputed)


__all__ = ["Pin", "choose_loss"]
