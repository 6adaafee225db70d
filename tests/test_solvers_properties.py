"""Property tests on random small DAG problems, checked against a brute-force oracle.

Problems have up to 10 values, so the oracle can enumerate every keep set. Storages
are shared at random (views), flags are random (tuple ops, random ops), some storages are
empty. Costs are whole milliseconds so equal costs are really equal.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from remat_pass.solvers import SOLVERS, BudgetInfeasibleError, Problem, Value, min_feasible_bytes, solve
from tests.test_solvers import oracle, oracle_min_bytes

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# "ilp_peak" bounds the simulated peak, not saved bytes: tests/test_peak.py covers it.
SAVED_SOLVERS = sorted(name for name in SOLVERS if name != "ilp_peak")
HEURISTICS = sorted(name for name in SAVED_SOLVERS if name not in ("ilp", "fast", "ilp_offload"))
TOLERANCE = 1e-9


@st.composite
def problems(draw: st.DrawFn, max_values: int = 10) -> Problem:
    available = draw(st.integers(0, 2))
    count = draw(st.integers(2, max_values))
    values = [Value(i, f"p{i}", (), storage=0, available=True) for i in range(available)]
    storage_bytes = [0]
    for i in range(available, available + count):
        inputs = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        if len(storage_bytes) > 1 and draw(st.integers(0, 3)) == 0:
            storage = draw(st.integers(1, len(storage_bytes) - 1))  # a view of an earlier value
        else:
            storage_bytes.append(draw(st.sampled_from([0, 8, 16, 24, 40, 64, 100])))
            storage = len(storage_bytes) - 1
        values.append(Value(
            i, f"v{i}", tuple(sorted(inputs)), storage,
            recompute_seconds=draw(st.integers(0, 5)) * 1e-3,
            recomputable=draw(st.integers(0, 4)) > 0,
            keepable=draw(st.integers(0, 5)) > 0,
        ))
    keepable = [v.id for v in values if v.keepable and not v.available]
    reads = draw(st.sets(st.sampled_from(keepable), min_size=1)) if keepable else set()
    if available and draw(st.booleans()):
        reads.add(draw(st.integers(0, available - 1)))  # backward may read inputs too: free
    return Problem(tuple(values), tuple(storage_bytes), frozenset(reads))


def budgets(problem: Problem) -> st.SearchStrategy[int]:
    """Mostly below keep-all, where there is something to decide."""
    total = problem.keep_all_bytes()
    return st.one_of(st.integers(0, max(total - 1, 0)), st.integers(0, total + 10))


@SETTINGS
@given(st.data())
def test_plan_fits_and_is_optimal_or_budget_is_infeasible(data: st.DataObject) -> None:
    problem = data.draw(problems())
    budget = data.draw(budgets(problem))
    expected = oracle(problem, budget)
    event("infeasible" if expected is None else "keep-all" if budget >= problem.keep_all_bytes() else "solved")
    try:
        plan = solve(problem, budget)
    except BudgetInfeasibleError as error:
        assert expected is None
        assert error.min_bytes == oracle_min_bytes(problem) > budget
        assert solve(problem, error.min_bytes).kept_bytes <= error.min_bytes
        return
    assert expected is not None
    plan.check()
    assert plan.kept_bytes <= budget
    assert plan.recompute_seconds == pytest.approx(expected[0], abs=TOLERANCE)
    assert (plan.status, plan.gap) == ("optimal", 0.0)
    if budget >= problem.keep_all_bytes():  # returned as is, even where zero-cost recomputes could save bytes
        assert plan.recomputed == frozenset()
    else:  # the tie-break: no byte more than an optimal plan needs
        assert plan.kept_bytes == expected[1]


@SETTINGS
@given(problems())
def test_min_feasible_bytes_matches_brute_force(problem: Problem) -> None:
    assert min_feasible_bytes(problem) == oracle_min_bytes(problem)


@SETTINGS
@given(st.data())
def test_more_budget_never_means_more_recompute(data: st.DataObject) -> None:
    problem = data.draw(problems())
    low = data.draw(st.integers(min_feasible_bytes(problem), problem.keep_all_bytes()))
    high = data.draw(st.integers(low, problem.keep_all_bytes() + 10))
    assert solve(problem, high).recompute_seconds <= solve(problem, low).recompute_seconds + TOLERANCE


@SETTINGS
@given(problems())
def test_unlimited_budget_recomputes_nothing(problem: Problem) -> None:
    plan = solve(problem, None)
    assert plan.recomputed == frozenset()
    assert plan.kept_bytes == problem.keep_all_bytes()


@SETTINGS
@given(st.data())
def test_ilp_never_worse_than_a_baseline_that_fits(data: st.DataObject) -> None:
    problem = data.draw(problems())
    budget = data.draw(budgets(problem))
    fitting = [p for p in (solve(problem, budget, name) for name in HEURISTICS) if p.kept_bytes <= budget]
    if not fitting:
        return
    exact = solve(problem, budget)
    for heuristic in fitting:
        heuristic.check()
        assert exact.recompute_seconds <= heuristic.recompute_seconds + TOLERANCE, heuristic.solver
