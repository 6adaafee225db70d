"""With offload=True the driver never uses a plan slower than recompute alone at the same budget."""

from types import SimpleNamespace

import pytest

from remat_pass import solvers
from remat_pass.planning import pipeline


def _planned(extra_seconds: float, offloaded: bool) -> SimpleNamespace:
    return SimpleNamespace(plan=SimpleNamespace(predicted_extra_seconds=extra_seconds, offloaded=offloaded))


@pytest.mark.parametrize(("offload_s", "recompute_s", "expect_offload"), [(2.0, 1.0, False), (1.0, 2.0, True)])
def test_the_faster_of_offload_and_recompute_is_used(monkeypatch, offload_s, recompute_s, expect_offload):
    calls = []

    def fake_solve_one(problem, options, budget):
        calls.append(options.offload)
        return _planned(offload_s, True) if options.offload else _planned(recompute_s, False)

    monkeypatch.setattr(pipeline, "_solve_one", fake_solve_one)
    options = SimpleNamespace(offload=True)
    monkeypatch.setattr(pipeline, "replace", lambda opts, **changes: SimpleNamespace(**{**vars(opts), **changes}))
    chosen = pipeline._solve(None, options, None)
    assert calls == [True, False]
    assert chosen.plan.offloaded is expect_offload


def test_offload_fits_where_recompute_alone_cannot(monkeypatch):
    def fake_solve_one(problem, options, budget):
        if not options.offload:
            raise solvers.BudgetInfeasibleError(10, 20, 100)
        return _planned(5.0, True)

    monkeypatch.setattr(pipeline, "_solve_one", fake_solve_one)
    monkeypatch.setattr(pipeline, "replace", lambda opts, **changes: SimpleNamespace(**{**vars(opts), **changes}))
    assert pipeline._solve(None, SimpleNamespace(offload=True), None).plan.offloaded is True
