"""The step rows of the peak planner (``solvers.peak_rows``) on hand-made problems."""

from __future__ import annotations

from remat_pass.solvers._model import rounding_for, weights_for
from remat_pass.solvers._run import solve_once
from remat_pass.solvers.memory import simulate_plan
from remat_pass.solvers.peak_rows import PeakRows
from remat_pass.solvers.problem import BackwardStep, Problem, Value


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
