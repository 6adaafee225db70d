"""CP-SAT as a backend (``solvers.mip.cpsat``): exact where it claims to be, refusing what it cannot take."""

from __future__ import annotations

import pulp
import pytest

from remat_pass.solvers.mip import solve as _mip, cpsat
from remat_pass.solvers.errors import SolverError, SolverUnavailableError

pytestmark = pytest.mark.skipif(not cpsat.available(), reason="OR-Tools is not installed")

SIZES = (23, 31, 29, 44, 53, 38, 63, 85, 89, 82)
GAINS = (92, 57, 49, 68, 60, 43, 67, 84, 87, 72)


def _knapsack(scale: float = 1.0) -> pulp.LpProblem:
    """Least gain dropped (``scale`` per unit) from ten items so that the rest fit 165: a 0/1
    model whose optimum (drops 370 of the 679 units: keeps 309) CP-SAT and HiGHS must agree on."""
    model = pulp.LpProblem("knapsack", pulp.LpMinimize)
    drop = [_mip.binary(model, f"d{i}") for i in range(len(SIZES))]
    model += pulp.lpSum(scale * gain * d for gain, d in zip(GAINS, drop))
    model += pulp.lpSum(size * d for size, d in zip(SIZES, drop)) >= sum(SIZES) - 165, "capacity"
    return model


def test_an_integer_objective_is_solved_to_the_proven_optimum_highs_finds():
    cp = _mip.run_mip(_knapsack(), backend="cpsat", time_limit=10)
    highs = _mip.run_mip(_knapsack(), backend="highs", time_limit=10)
    assert cp.status == highs.status == "optimal"
    assert cp.objective == pytest.approx(highs.objective) == 370
    assert cp.bound == pytest.approx(370)


def test_a_fractional_objective_gives_a_true_lower_bound_and_claims_no_proof():
    """Seconds are floats: scaled and rounded down, CP-SAT's bound stays below the optimum, and
    "optimal" is not claimed from the rounded objective."""
    result = _mip.run_mip(_knapsack(scale=0.1), backend="cpsat", time_limit=10)
    assert result.status == "feasible"
    assert result.objective == pytest.approx(37.0)
    assert result.objective * (1 - 1e-9) <= result.bound <= result.objective


def test_an_implied_integral_variable_is_taken_as_an_integer_and_others_are_refused():
    """A max of 0/1 literals (``mip.solve.fraction``) is fine; an arbitrary continuous one is not."""
    model = pulp.LpProblem("either", pulp.LpMinimize)
    a, b = _mip.binary(model, "a"), _mip.binary(model, "b")
    either = _mip.fraction(model, "either")
    model += 3 * either - a - b
    model += either >= a, "ea"
    model += either >= b, "eb"
    model += a + b >= 1, "one"
    result = _mip.run_mip(model, backend="cpsat", time_limit=10)
    assert result.status == "optimal" and result.objective == pytest.approx(1.0)  # both on, either paid once

    loose = pulp.LpProblem("loose", pulp.LpMinimize)
    x = (loose.add_variable("x", 0, 2.5, cat=pulp.LpContinuous) if hasattr(loose, "add_variable")
         else pulp.LpVariable("x", lowBound=0, upBound=2.5))
    loose += x
    loose += x >= 0.5, "half"
    with pytest.raises(SolverError, match="'x' is continuous"):
        _mip.run_mip(loose, backend="cpsat", time_limit=10)


def test_a_row_with_a_fractional_coefficient_is_refused_not_rounded():
    model = pulp.LpProblem("fractional_row", pulp.LpMinimize)
    a = _mip.binary(model, "a")
    model += a
    model += 0.5 * a >= 0.25, "half"
    with pytest.raises(SolverError, match="integer coefficients"):
        _mip.run_mip(model, backend="cpsat", time_limit=10)


def test_an_infeasible_model_is_reported_infeasible():
    model = _knapsack()
    model += pulp.lpSum(model.variables()) >= len(SIZES) + 1, "more_than_all"
    assert _mip.run_mip(model, backend="cpsat", time_limit=10).status == "infeasible"


def test_without_ortools_the_backend_names_the_install(monkeypatch):
    _mip._backend_works.cache_clear()
    monkeypatch.setattr(cpsat, "available", lambda: False)
    try:
        with pytest.raises(SolverUnavailableError, match="pip install ortools"):
            _mip.resolve_backend("cpsat")
    finally:
        _mip._backend_works.cache_clear()


def test_the_exact_rows_use_cpsat_when_installed_and_the_main_backend_otherwise(monkeypatch):
    from remat_pass.solvers.peak.exact_rows import exact_backend_for

    assert exact_backend_for("auto", "highs") == "cpsat"
    assert exact_backend_for("highs", "cbc") == "highs"
    monkeypatch.setattr(_mip, "_backend_works", lambda name: name != "cpsat")
    assert exact_backend_for("auto", "cbc") == "cbc"


def test_an_objective_column_that_may_be_negative_is_refused():
    """Rounding a term down bounds it from below only for a column >= 0."""
    model = pulp.LpProblem("negative", pulp.LpMinimize)
    x = (model.add_variable("x", -3, 3, cat=pulp.LpInteger) if hasattr(model, "add_variable")
         else pulp.LpVariable("x", lowBound=-3, upBound=3, cat=pulp.LpInteger))
    model += 0.1 * x
    model += x >= -2, "low"
    with pytest.raises(SolverError, match="may be negative"):
        _mip.run_mip(model, backend="cpsat", time_limit=10)
