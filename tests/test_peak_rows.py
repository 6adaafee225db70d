"""The step rows of the peak planner (``solvers.peak.rows``) on hand-made problems."""

from __future__ import annotations

import pytest

from remat_pass.solvers import baselines
from remat_pass.solvers.mip.backend_run import model_rows
from remat_pass.solvers.mip.keep_model import build, rounding_for, time_weights, weights_for
from remat_pass.solvers.mip.run_keep import solve_once
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.peak.rows import PeakRows
from remat_pass.solvers.problem import BackwardStep, Problem, Value

from .test_fast_solver import random_problem


def _scores_then_softmax() -> Problem:
    """x -> s (8 B, read by no backward step) -> p (8 B, read at step 1). Step 0 has a 20-byte
    working set that is all kernel scratch; step 1 a 16-byte one. Keeping s or p holds it across
    step 0 (28 B); recomputing both makes s and p at step 1 before its working set exists
    (16 B), then runs step 1 beside p (24 B)."""
    values = (
        Value(0, "x", (), storage=0, available=True),
        Value(1, "s", (0,), storage=1, recompute_seconds=1.0),
        Value(2, "p", (1,), storage=2, recompute_seconds=1.0),
    )
    steps = (BackwardStep((), working_bytes=20, scratch_bytes=20), BackwardStep((2,), working_bytes=16))
    return Problem(values, (0, 8, 8), frozenset({2}), backward_steps=steps)


def test_transients_are_counted_beside_the_working_set_of_their_moment():
    """The inputs alive while a value is made (``transients``) die before the step's op runs: they
    share memory with the previous step's working set less its scratch, not with the op's. Counted
    beside the op's working set, the rows refused the only plan that fits (32 B > 24 B)."""
    problem = _scores_then_softmax()
    rounding = rounding_for(problem)
    rows = PeakRows(problem, 24, rounding, transients=True, kept_readers=True)
    outcome = solve_once(problem, None, rounding=rounding, weights=weights_for(problem), time_limit=10,
                         backend="highs", extension=rows)
    assert outcome.plan is not None and outcome.plan.recomputed == {1, 2}
    assert simulate_plan(problem, outcome.plan).peak_bytes == 24
    tighter = PeakRows(problem, 23, rounding, transients=True, kept_readers=True)
    assert solve_once(problem, None, rounding=rounding, weights=weights_for(problem), time_limit=10,
                      backend="highs", extension=tighter).plan is None


class _OnePerRow(PeakRows):
    """The rows with a variable per row for a storage alive through several views, as they were
    built before one was shared by every row with the same literals."""

    @staticmethod
    def _pay_alive(model, reads, row, t, coefficients, either):
        PeakRows._pay_alive(model, reads, row, t, coefficients, {})


def _alive_rows(problem: Problem, rows: PeakRows) -> int:
    model = build(problem, rows.rounding, None, weights_for(problem))
    rows.add(model)
    return sum(1 for row in model_rows(model.lp) if row.name.startswith("alive"))


def _check_one_variable_per_literal_set(problem: Problem, budget: int) -> None:
    """Sharing the variable of a storage alive through several views among the rows with the same
    literals changes neither the relaxation's bound nor the conservative rows' optimum, and needs
    fewer rows."""
    conservative = rounding_for(problem)
    relaxed = conservative.optimistic()
    results = []
    for make in (PeakRows, _OnePerRow):
        bound = solve_once(problem, None, rounding=relaxed, weights=time_weights(problem)[0], time_limit=30,
                           backend="highs", extension=make(problem, budget, relaxed))
        plan = solve_once(problem, None, rounding=conservative, weights=weights_for(problem), time_limit=30,
                          backend="highs", extension=make(problem, budget, conservative, transients=True,
                                                          kept_readers=True))
        assert bound.status == plan.status == "optimal"
        results.append((bound.bound, plan.plan.predicted_extra_seconds))
    assert results[0] == pytest.approx(results[1], rel=1e-9)
    assert results[0][1] > 0  # the rows bind: the plan recomputes
    shared, per_row = (_alive_rows(problem, make(problem, budget, conservative, transients=True, kept_readers=True))
                       for make in (PeakRows, _OnePerRow))
    assert shared < per_row


@pytest.mark.parametrize("seed", [2, 4, 5, 6])
def test_a_storage_alive_through_several_views_is_one_variable_for_all_rows(seed):
    problem = random_problem(seed, blocks=4, size=14)
    _check_one_variable_per_literal_set(problem, simulate_plan(problem, baselines.keep_all(problem)).peak_bytes * 3 // 4)


@pytest.mark.parametrize("fraction", [0.4, 0.6])
def test_one_variable_per_literal_set_on_a_traced_gpt(gpt_step, fraction):
    """The same on a traced two-layer GPT (views of layer norms, attention, dropout)."""
    per_block = simulate_plan(gpt_step, baselines.per_block(gpt_step)).peak_bytes
    keep_all = simulate_plan(gpt_step, baselines.keep_all(gpt_step)).peak_bytes
    _check_one_variable_per_literal_set(gpt_step, int(per_block + fraction * (keep_all - per_block)))
