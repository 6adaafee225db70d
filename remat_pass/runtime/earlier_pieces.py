"""A peak budget over a step split into pieces: each piece gets what the others leave of it.

Dynamo splits a step at graph breaks (``optimize(..., fullgraph=False)``); the pieces are compiled,
planned and run in turn, so a piece's forward and backward run while every earlier piece of the
same step still holds what it saved for its own backward (backward runs the pieces in reverse).
Given to each piece whole, a peak budget is broken by that sum: 2- and 3-piece MLP stacks at 0.3-0.7
of eager's peak measured 1.43-2.50 times their budget, eager and Inductor
(``benchmarks/results/graph_breaks/``; ``tests/test_pieces_and_shapes.py`` checks the step's peak). So a piece
peaks within the user's budget less what the earlier pieces of the call keep (``held``), and keeps
at most that less what the later pieces need (``reserved``; ``planning.kept_cap``).

The later pieces are not traced yet when an earlier one is planned, so what they need is learnt: a
piece refused beside what the earlier ones keep records its lowest peak and what the plan with that
peak keeps, and the first call is run again (its buffers and random-number state as before it),
every piece planned anew at its next run. A piece reserves ``R = max(peak, kept + R')`` for the
later ones, from the last back (``R'``: what the next one reserves): each later piece then has room
to peak at its lowest beside what the pieces between it and this one keep, at most what they keep
at theirs, so the known pieces fit any budget of at least the first piece's ``R``
(``PieceShares.reserved_after(-1)``). The bound is conservative: a value an earlier piece keeps and a
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
    their backward, and what it reserves for the later ones (``PieceShares.reserved_after``)."""

    index: int = 0
    held: int = 0
    reserved: int = 0

    @property
    def others(self) -> int:
        return self.held + self.reserved


@dataclass(frozen=True)
class Lowest:
    """The lowest peak found for a piece, and what the plan with that peak keeps for backward (the
    peak itself where the refusal did not say)."""

    peak: int
    kept: int

    @classmethod
    def of(cls, error: solvers.BudgetInfeasibleError) -> Lowest:
        kept = error.lowest_kept_bytes
        return cls(error.min_bytes, min(kept, error.min_bytes) if kept is not None else error.min_bytes)


@dataclass(frozen=True)
class Refused:
    """A piece refused under a shared peak budget: where it stood and its lowest peak."""

    beside: Beside
    lowest: Lowest


@dataclass
class PieceShares:
    """The lowest peaks of the step's pieces learnt from their refusals, by place in the step."""

    lowest: dict[int, Lowest] = field(default_factory=dict)

    def beside(self, index: int, earlier: Iterable[Plan]) -> Beside:
        """Where the piece compiled now stands, ``earlier`` the plans the call ran before it."""
        return Beside(index, held_by(earlier), self.reserved_after(index))

    def reserved_after(self, index: int) -> int:
        """What piece ``index`` leaves the later pieces: ``R = max(peak, kept + R')`` from the last known
        piece back (``R'`` the next one's), so that each later piece can peak at its lowest beside what
        the pieces between keep at theirs; ``reserved_after(-1)`` is the budget every known piece fits."""
        reserved = 0
        for place in sorted((place for place in self.lowest if place > index), reverse=True):
            reserved = max(self.lowest[place].peak, self.lowest[place].kept + reserved)
        return reserved

    def learn(self, refused: Refused | None, budget_bytes: int) -> bool:
        """Record a later piece's refusal beside what earlier pieces keep; whether planning the step
        again could then fit it (a piece not yet known, and the known pieces within the budget)."""
        if refused is None or refused.beside.held <= 0 or refused.beside.index in self.lowest:
            return False
        self.lowest[refused.beside.index] = refused.lowest
        if self.reserved_after(-1) > budget_bytes:
            del self.lowest[refused.beside.index]
            return False
        return True


def held_by(plans: Iterable[Plan]) -> int:
    """Bytes the ``plans`` of the earlier pieces keep on the device for backward (one per run: a graph
    the call ran twice holds two sets of saved tensors)."""
    return sum(plan.kept_bytes for plan in plans)


def bounds_the_step_peak(options: PlanOptions) -> bool:
    """Whether ``options``' budget is an absolute peak: the one the pieces of a step share."""
    return options.budget.nbytes is not None and resolve_budget_kind(options.budget, options.budget_kind) is BudgetKind.PEAK


def left_for_piece(options: PlanOptions, beside: Beside | None) -> PlanOptions:
    """``options`` with an absolute peak budget lowered by what the earlier pieces keep, and what the
    piece may keep capped so that what the later pieces need fits beside it (``planning.kept_cap``);
    at least 1 byte is left, so that a piece with nothing left is refused with its own minimum."""
    if beside is None or beside.others <= 0 or not bounds_the_step_peak(options):
        return options
    assert options.budget.nbytes is not None
    left = max(options.budget.nbytes - beside.held, 1)
    cap = max(left - beside.reserved, 1) if beside.reserved else None
    logger.info("piece %d of the step: the earlier pieces keep %d of the %d-byte peak budget, %d left for it%s",
                beside.index + 1, beside.held, options.budget.nbytes, left,
                "" if cap is None else f", and it keeps at most {cap} (what the later pieces need reserved)")
    return replace(options, budget=Budget(nbytes=left), budget_kind=BudgetKind.PEAK, kept_cap_bytes=cap)


def explain_refusal(error: solvers.BudgetInfeasibleError, options: PlanOptions, beside: Beside | None,
                    shares: PieceShares) -> None:
    """Put into a piece's refusal what the other pieces take of the budget, and the budget that always
    fits (the refusal's own "Pass budget=..." names the piece's share, not the step's)."""
    if beside is None or beside.others <= 0 or not bounds_the_step_peak(options):
        return
    assert options.budget.nbytes is not None
    known = PieceShares({**shares.lowest, beside.index: Lowest.of(error)})
    found = ", ".join(f"piece {place + 1}: {lowest.peak} keeping {lowest.kept}"
                      for place, lowest in sorted(known.lowest.items()))
    because = (f"This is piece {beside.index + 1} of a step split at graph breaks: the earlier pieces keep "
               f"{beside.held} bytes for their backward, alive through its forward and backward, and "
               f"{beside.reserved} are reserved for what the later pieces need, so it had "
               f"{max(options.budget.nbytes - beside.held, 1)} of the {options.budget.nbytes}-byte peak budget to peak "
               f"in and {max(options.budget.nbytes - beside.others, 1)} to keep. Planned in turn, the pieces found so "
               f"far fit any budget of at least {known.reserved_after(-1)} bytes (their lowest peaks and what those "
               f"plans keep: {found}); without the graph breaks (fullgraph=True says where they are) the step is "
               "planned as one graph.")
    text = error.args[0]
    piece_share = f"Pass budget={error.min_bytes} or more."
    error.args = (text.replace(piece_share, because) if piece_share in text else f"{text} {because}",)
