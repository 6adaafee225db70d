"""The plan-level peak model (``solvers.analysis.memory``) on hand-made problems: outputs held to the end."""

from __future__ import annotations

import pytest

from remat_pass.solvers.mip import cpsat
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.problem import BackwardStep, Plan, Problem, Value


def _with_output() -> Problem:
    """x -> a -> b -> out; backward reads a then b; out (the step's output) is read by no one."""
    x = Value(0, "x", (), storage=0, available=True)
    a = Value(1, "a", (0,), storage=1, recompute_seconds=1e-3)
    b = Value(2, "b", (1,), storage=2, recompute_seconds=1e-3)
    out = Value(3, "out", (2,), storage=3, recompute_seconds=1e-3)
    steps = (BackwardStep((2,), 10), BackwardStep((1,), 10))
    return Problem((x, a, b, out), (0, 100, 100, 400), frozenset({1, 2}), forward_outputs=frozenset({3}),
                   backward_steps=steps)


def test_keeping_an_output_never_lowers_the_modelled_peak():
    """Issue 15 R7: a kept output was freed after its last backward use, an unkept one held to the
    end, so keeping an output nobody reads could lower the modelled peak."""
    problem = _with_output()
    plain = Plan(problem, frozenset({1, 2}), frozenset(), "manual")
    with_output = Plan(problem, frozenset({1, 2, 3}), frozenset(), "manual")
    assert simulate_plan(problem, with_output).peak_bytes == simulate_plan(problem, plain).peak_bytes == 610


def test_a_recomputed_output_is_a_second_tensor():
    """The caller still holds the forward's output while backward rebuilds it."""
    x = Value(0, "x", (), storage=0, available=True)
    out = Value(1, "out", (0,), storage=1, recompute_seconds=1e-3)
    problem = Problem((x, out), (0, 100), frozenset({1}), forward_outputs=frozenset({1}),
                      backward_steps=(BackwardStep((1,), 0),))
    kept = Plan(problem, frozenset({1}), frozenset(), "manual")
    rebuilt = Plan(problem, frozenset(), frozenset({1}), "manual")
    assert simulate_plan(problem, kept).peak_bytes == 100
    assert simulate_plan(problem, rebuilt).peak_bytes == 200


def _brute_force(problem: Problem) -> list[tuple[int, float]]:
    """(simulated peak, recompute seconds) of every keep-set closure: every plan worth making."""
    from itertools import combinations

    from remat_pass.solvers.analysis.graph_facts import relevant_values
    from remat_pass.solvers.problem import closure_from_keep_set

    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    seen, found = set(), []
    for size in range(len(keepable) + 1):
        for keep in combinations(keepable, size):
            kept, recomputed = closure_from_keep_set(problem, keep)
            if (kept, recomputed) in seen:
                continue
            seen.add((kept, recomputed))
            plan = Plan(problem, kept, recomputed, "brute")
            found.append((simulate_plan(problem, plan).peak_bytes, plan.recompute_seconds))
    return found


@pytest.mark.parametrize("exact_backend", ["highs", pytest.param("cpsat", marks=pytest.mark.skipif(
    not cpsat.available(), reason="OR-Tools is not installed"))])
def test_peak_planner_against_brute_force(exact_backend):
    """On the two-block transformer of the solver tests: never over budget, a refusal only when no
    plan fits, "optimal" only at the true optimum, a stated gap never smaller than the true one;
    with the exact rows on HiGHS and on CP-SAT (whose proofs go through a scaled objective)."""
    from remat_pass.solvers import BudgetInfeasibleError, solve

    from .test_solvers import transformer

    problem = transformer()
    plans = _brute_force(problem)
    lowest, highest = min(p for p, _ in plans), max(p for p, _ in plans)
    for budget in sorted({lowest - 1, lowest, *range(lowest, highest + 1, max((highest - lowest) // 12, 1)), highest}):
        fitting = [seconds for peak, seconds in plans if peak <= budget]
        if not fitting:
            with pytest.raises(BudgetInfeasibleError):
                solve(problem, budget, "ilp_peak", time_limit=10, exact_backend=exact_backend)
            continue
        plan = solve(problem, budget, "ilp_peak", time_limit=10, exact_backend=exact_backend)
        best = min(fitting)
        assert plan.predicted_peak_bytes <= budget
        assert plan.recompute_seconds >= best - 1e-12
        if plan.status == "optimal":
            assert plan.recompute_seconds == pytest.approx(best, rel=1e-6, abs=1e-12), budget
        if plan.gap is not None:
            assert plan.recompute_seconds - best <= plan.gap * plan.recompute_seconds + 1e-9, budget
