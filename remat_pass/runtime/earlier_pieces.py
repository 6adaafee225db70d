"""A peak budget over a step split into pieces: each piece gets what the others leave of it.

Dynamo splits a step at graph breaks (``optimize(..., fullgraph=False)``); the pieces are compiled,
planned and run in turn, so a piece's forward and backward run while every earlier piece of the
same step still holds what it saved for its own backward (backward runs the pieces in reverse).
Given to each piece whole, a peak budget is broken by that sum: the 2-piece MLP stack of
``tests/test_pieces_and_shapes.py`` planned at 0.6 and 0.4 of eager's step peak measured 1.49 and
1.47 of its budget (BatchNorm, dropout, the loss inside, ``inner="eager"``). So a piece
peaks within the user's budget less what the earlier pieces of the call keep (``held``), and keeps
at most that less the lowest peaks of the later pieces (``reserved``; ``planning.kept_cap``).

The later pieces are not traced yet when an earlier one is planned, so their lowest peaks are
learnt: a piece refused beside what the earlier ones keep records its lowest peak, and the first
call is run again (its buffers and random-number state as before it), every piece planned anew
at its next run. Each piece then leaves the later ones at least the sum of their lowest peaks,
so each has at least its own. The bound is conservative: a value an earlier piece keeps and a
later one takes as its input is charged to both. ``plan()`` and ``explain`` plan the pieces as one
problem instead (``planning.tracing``); a budget of saved bytes or a fraction bounds each piece on
its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Iterable

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from ..planning.budget import Budget
from ..planning.pipeline import BudgetKind, PlanOptions, resolve_budget_kind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Beside:
    """Where a piece stands in its step: its place (0 first), the bytes the earlier pieces keep for
    their backward, and the lowest peaks reserved for the later ones."""

    index: int = 0
    held: int = 0
    reserved: int = 0

    @property
    def others(self) -> int:
        return self.held + self.reserved


@dataclass(frozen=True)
class Refused:
    """A piece refused under a shared peak budget: where it stood and the lowest peak found for it."""

    beside: Beside
    lowest: int


@dataclass
class PieceShares:
    """The lowest peaks of the step's pieces learnt from their refusals, by place in the step."""

    lowest: dict[int, int] = field(default_factory=dict)

    def beside(self, index: int, earlier: Iterable[Plan]) -> Beside:
        """Where the piece compiled now stands, ``earlier`` the plans the call ran or compiled before it."""
        return Beside(index, held_by(earlier), sum(peak for place, peak in self.lowest.items() if place > index))

    def learn(self, refused: Refused | None, budget_bytes: int) -> bool:
        """Record a later piece's refusal beside what earlier pieces keep; whether planning the step
        again could then fit it (a piece not yet known, and the known lowest peaks within the budget)."""
        if refused is None or refused.beside.held <= 0 or refused.beside.index in self.lowest:
            return False
        if sum(self.lowest.values()) + refused.lowest > budget_bytes:
            return False
        self.lowest[refused.beside.index] = refused.lowest
        return True


def held_by(plans: Iterable[Plan]) -> int:
    """Bytes the ``plans`` (of earlier pieces, each counted once) keep on the device for backward."""
    return sum(plan.kept_bytes for plan in {id(plan): plan for plan in plans}.values())


def bounds_the_step_peak(options: PlanOptions) -> bool:
    """Whether ``options``' budget is an absolute peak: the one the pieces of a step share."""
    return options.budget.nbytes is not None and resolve_budget_kind(options.budget, options.budget_kind) is BudgetKind.PEAK


def left_for_piece(options: PlanOptions, beside: Beside | None) -> PlanOptions:
    """``options`` with an absolute peak budget lowered by what the earlier pieces keep, and what the
    piece may keep capped so that the later pieces' lowest peaks fit beside it (``planning.kept_cap``);
    at least 1 byte is left, so that a piece with nothing left is refused with its own minimum."""
    if beside is None or beside.others <= 0 or not bounds_the_step_peak(options):
        return options
    assert options.budget.nbytes is not None
    left = max(options.budget.nbytes - beside.held, 1)
    cap = max(left - beside.reserved, 1) if beside.reserved else None
    logger.info("piece %d of the step: the earlier pieces keep %d of the %d-byte peak budget, %d left for it%s",
                beside.index + 1, beside.held, options.budget.nbytes, left,
                "" if cap is None else f", and it keeps at most {cap} (the later pieces' lowest peaks reserved)")
    return replace(options, budget=Budget(nbytes=left), budget_kind=BudgetKind.PEAK, kept_cap_bytes=cap)


def explain_refusal(error: solvers.BudgetInfeasibleError, options: PlanOptions, beside: Beside | None,
                    shares: PieceShares) -> None:
    """Put into a piece's refusal what the other pieces take of the budget, and the budget that always
    fits (the refusal's own "Pass budget=..." names the piece's share, not the step's)."""
    if beside is None or beside.others <= 0 or not bounds_the_step_peak(options):
        return
    assert options.budget.nbytes is not None
    lowest = {**shares.lowest, beside.index: error.min_bytes}
    known = ", ".join(f"piece {place + 1}: {peak}" for place, peak in sorted(lowest.items()))
    because = (f"This is piece {beside.index + 1} of a step split at graph breaks: the earlier pieces keep "
               f"{beside.held} bytes for their backward, alive through its forward and backward, and "
               f"{beside.reserved} are reserved for the later pieces' lowest peaks, so it had "
               f"{max(options.budget.nbytes - beside.held, 1)} of the {options.budget.nbytes}-byte peak budget to peak "
               f"in and {max(options.budget.nbytes - beside.others, 1)} to keep. Planned in turn, the pieces fit any "
               f"budget of at least the sum of their lowest peaks (found so far: {known}; {sum(lowest.values())} "
               "bytes together); without the graph breaks (fullgraph=True says where they are) the step is planned "
               "as one graph.")
    text = error.args[0]
    piece_share = f"Pass budget={error.min_bytes} or more."
    error.args = (text.replace(piece_share, because) if piece_share in text else f"{text} {because}",)
