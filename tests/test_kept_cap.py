"""planning.kept_cap: a peak-budget plan that also keeps at most a cap (a piece of a split step),
against a planner stand-in whose plans keep a known share of their peak budget."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from remat_pass import solvers
from remat_pass.planning.budget import Budget
from remat_pass.planning.kept_cap import keeping_at_most
from remat_pass.planning.pipeline import BudgetKind, PlanOptions


@dataclass(frozen=True)
class _Plan:
    kept_bytes: int
    predicted_peak_bytes: int
    budget_bytes: int
    budget_kind: str


@dataclass(frozen=True)
class _Budget:
    budget_bytes: int
    target_bytes: int
    kind: str = BudgetKind.PEAK


@dataclass(frozen=True)
class _Planned:
    plan: _Plan
    budget: _Budget


class _Planner:
    """Peak plans keep the budget less ``transient`` and refuse below ``lowest``; a saved-bytes plan
    keeps its budget and peaks ``saved_transient`` over it."""

    def __init__(self, transient: int, lowest: int, saved_transient: int) -> None:
        self.transient, self.lowest, self.saved_transient = transient, lowest, saved_transient
        self.asked: list[tuple[str, int]] = []

    def __call__(self, options: PlanOptions) -> _Planned:
        nbytes = options.budget.nbytes
        assert nbytes is not None and options.kept_cap_bytes is None
        self.asked.append((str(options.budget_kind), nbytes))
        if options.budget_kind == "saved":
            return _Planned(_Plan(nbytes, nbytes + self.saved_transient, nbytes, "saved"), _Budget(nbytes, nbytes, "saved"))
        if nbytes < self.lowest:
            raise solvers.BudgetInfeasibleError(nbytes, self.lowest, 10_000, kind="peak")
        return _Planned(_Plan(nbytes - self.transient, nbytes, nbytes, "peak"), _Budget(nbytes, nbytes))


def _options(budget: int, cap: int | None) -> PlanOptions:
    return PlanOptions(Budget(nbytes=budget), budget_kind=BudgetKind.PEAK, kept_cap_bytes=cap)


def test_a_plan_within_the_cap_is_kept_as_made():
    planner = _Planner(transient=300, lowest=500, saved_transient=0)
    first = planner(_options(1000, None))
    assert keeping_at_most(_options(1000, 800), first, planner) is first
    assert keeping_at_most(_options(1000, None), first, planner) is first


def test_a_plan_over_the_cap_is_planned_lower_and_reported_against_the_budget_asked():
    planner = _Planner(transient=300, lowest=500, saved_transient=0)
    first = planner(_options(1000, None))  # keeps 700
    chosen = keeping_at_most(_options(1000, 600), first, planner)
    assert planner.asked[-1] == ("peak", 900)  # lowered by the 100-byte excess
    assert chosen.plan.kept_bytes <= 600
    assert chosen.plan.budget_bytes == 1000 and chosen.budget == first.budget


def test_below_the_lowest_peak_the_saved_bytes_plan_is_taken_where_its_peak_fits():
    # Peak plans keep all but 100 bytes and none peaks below 900: no peak plan keeps 500 or less;
    # the plan keeping at most 500 as saved bytes peaks at 800, within the 1000 asked.
    planner = _Planner(transient=100, lowest=900, saved_transient=300)
    first = planner(_options(1000, None))
    chosen = keeping_at_most(_options(1000, 500), first, planner)
    assert ("saved", 500) in planner.asked
    assert chosen.plan.kept_bytes == 500 and chosen.plan.budget_bytes == 1000 and chosen.plan.budget_kind == "peak"


def test_where_no_plan_keeps_within_the_cap_the_cap_as_peak_budget_is_refused():
    planner = _Planner(transient=100, lowest=900, saved_transient=600)  # the saved plan peaks at 1100
    first = planner(_options(1000, None))
    with pytest.raises(solvers.BudgetInfeasibleError) as refused:
        keeping_at_most(_options(1000, 500), first, planner)
    assert refused.value.budget_bytes == 500 and planner.asked[-1] == ("peak", 500)


def test_the_pieces_shares_reserve_what_the_later_pieces_need():
    from remat_pass.runtime.earlier_pieces import Beside, Lowest, PieceShares, Refused, left_for_piece

    shares = PieceShares()
    assert not shares.learn(Refused(Beside(0, 0, 0), Lowest(400, 100)), 1000)  # nothing held: the piece alone cannot
    assert shares.learn(Refused(Beside(2, 600, 0), Lowest(400, 150)), 1000)
    assert shares.learn(Refused(Beside(1, 700, 0), Lowest(300, 100)), 1000)
    assert not shares.learn(Refused(Beside(1, 200, 0), Lowest(300, 100)), 1000)  # known already: nothing to gain
    # Piece 2 keeps 100 at its lowest peak, beside which piece 3 peaks at 400: piece 1 leaves 500, not
    # the 700 of the two lowest peaks; piece 2 leaves piece 3 its 400.
    assert (shares.reserved_after(0), shares.reserved_after(1), shares.reserved_after(2)) == (500, 400, 0)
    assert not shares.learn(Refused(Beside(3, 500, 0), Lowest(800, 0)), 1000)  # then 100 + 150 + 800 > 1000
    assert shares.reserved_after(-1) == 500
    first = shares.beside(0, [])
    assert (first.held, first.reserved) == (0, 500)
    options = left_for_piece(_options(1000, None), first)
    assert options.budget.nbytes == 1000 and options.kept_cap_bytes == 500
    assert left_for_piece(PlanOptions(Budget(fraction=0.5)), first).kept_cap_bytes is None  # a fraction: each piece's own


def test_a_refusal_says_what_its_lowest_peak_plan_keeps():
    from remat_pass.runtime.earlier_pieces import Lowest

    error = solvers.BudgetInfeasibleError(100, 400, 1000, kind="peak", lowest_kept_bytes=150)
    assert Lowest.of(error) == Lowest(400, 150)
    assert Lowest.of(solvers.BudgetInfeasibleError(100, 400, 1000, kind="peak")) == Lowest(400, 400)  # not known
