"""remat_pass.sweep (remat_pass/tools/tradeoff.py): the trade-off curve on one traced step, the baselines, and the plots."""

from __future__ import annotations

import json
import sys

import pytest

from remat_pass.errors import InvalidBudgetError
from remat_pass.planning.pipeline import trace_step
from remat_pass.tools.plots import plot_memory_timeline, plot_pareto
from remat_pass.tools.tradeoff import BASELINES, INFEASIBLE, OVER_BUDGET, Sweep, sweep_traced

from .explain_factory import factory_dropout

# DropoutMLP: keep-all 320 bytes (fc1->dropout->tanh); its 64-byte dropout mask can never be recomputed.
KEEP_ALL, SMALLEST = 320, 64
BUDGETS = ("32B", 0.1, 0.25, 0.5, 0.75, 1.0, "200B")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traced():
    return trace_step(*factory_dropout())


@pytest.fixture(scope="module")
def curve(traced) -> Sweep:
    return sweep_traced(traced, BUDGETS, progress=False)


def test_curve_is_sorted_and_records_infeasible_budgets(curve):
    assert curve.keep_all_bytes == KEEP_ALL and curve.min_feasible_bytes == SMALLEST
    budgets = [p.budget_bytes for p in curve.points]
    assert budgets == sorted(budgets) == [32, 32, 80, 160, 200, 240, 320]  # 0.1 of 320 is 32 too
    for point in curve.points:
        if point.budget_bytes < SMALLEST:
            assert point.status == INFEASIBLE and point.plan is None and point.kept_bytes is None
        else:
            assert point.feasible and point.status == "optimal"
            assert point.kept_bytes <= point.budget_bytes
            assert point.fraction == pytest.approx(point.kept_bytes / KEEP_ALL)
    assert [p.budget for p in curve.points[:2]] in ([32, 0.1], [0.1, 32])  # "32B" is recorded as bytes


def test_more_budget_never_means_more_recompute(curve):
    feasible = [p for p in curve.points if p.feasible]
    assert len(feasible) == 5
    for smaller, larger in zip(feasible, feasible[1:]):
        assert larger.recompute_seconds <= smaller.recompute_seconds * (1 + 1e-9)
    assert feasible[0].recompute_seconds > 0  # it had to recompute to fit


def test_keep_all_at_full_budget(curve):
    full = curve.points[-1]
    assert full.budget == 1.0 and full.kept_bytes == KEEP_ALL and full.fraction == 1.0
    assert full.recompute_seconds == 0 and full.recompute_flops == 0 and full.flop_overhead == 0


def test_baselines_are_on_the_same_problem_and_never_beat_the_ilp(curve, traced):
    assert [b.solver for b in curve.baselines] == list(BASELINES)
    by_name = {b.solver: b for b in curve.baselines}
    assert by_name["keep_all"].kept_bytes == KEEP_ALL and by_name["keep_all"].recompute_seconds == 0
    assert by_name["recompute_all"].kept_bytes == SMALLEST  # only the mask
    for baseline in curve.baselines:
        assert baseline.plan.problem is traced.problem and baseline.budget is None
        fitting = [p for p in curve.points if p.feasible and p.budget_bytes >= baseline.kept_bytes]
        for point in fitting:
            assert point.recompute_seconds <= baseline.recompute_seconds * (1 + 1e-9) + 1e-15


def test_flop_overhead_is_relative_to_the_whole_step(curve, traced):
    assert curve.step_flops == traced.step_flops > 0
    for point in curve.points + curve.baselines:
        if point.feasible:
            assert point.flop_overhead == pytest.approx(point.recompute_flops / traced.step_flops)


def test_rows_and_json(curve):
    rows = curve.rows()
    assert [r["budget_bytes"] for r in rows] == [p.budget_bytes for p in curve.points]
    assert set(rows[0]) == {"solver", "budget", "budget_bytes", "status", "kept_bytes", "fraction",
                            "recompute_seconds", "recompute_flops", "flop_overhead"}
    data = json.loads(json.dumps(curve.to_dict()))
    assert data["keep_all_bytes"] == KEEP_ALL and len(data["baselines"]) == len(BASELINES)
    assert "infeasible" in str(curve) and "recompute_all" in str(curve)


def test_heuristic_sweeps_mark_plans_over_budget(traced):
    curve = sweep_traced(traced, (0.25, 1.0), "keep_all", baselines=(), progress=False)
    assert [p.status for p in curve.points] == [OVER_BUDGET, "feasible"]
    assert curve.min_feasible_bytes is None and curve.baselines == ()


def test_invalid_budgets_raise_before_solving(traced):
    with pytest.raises(InvalidBudgetError):
        sweep_traced(traced, (0.5, 1.5), progress=False)
    with pytest.raises(ValueError, match="unknown solver"):
        sweep_traced(traced, (0.5,), "nope", progress=False)


def test_package_level_sweep_is_the_function():
    import remat_pass.tools.tradeoff  # noqa: F401  (a submodule import must not shadow the function)

    assert callable(remat_pass.sweep) and remat_pass.sweep.__module__ == "remat_pass.tools.tradeoff"
    model, inputs = factory_dropout()
    curve = remat_pass.sweep(model, inputs, budgets=(0.5,), baselines=("keep_all",), progress=False)
    assert isinstance(curve, Sweep) and curve.points[0].kept_bytes <= 160


def test_pareto_and_timeline_plots_are_pngs(curve, tmp_path):
    path = plot_pareto(curve, tmp_path / "sub" / "pareto.png", highlight=curve.points[-2].plan)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    timeline = {"keep-all": [(0, 0), (1, 320), (2, 0)], "plan": [(0, 0), (1, 64), (2, 0)]}
    data = plot_memory_timeline(timeline, tmp_path / "timeline.png").read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError):
        plot_memory_timeline({}, tmp_path / "empty.png")


def test_missing_matplotlib_says_how_to_install(curve, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'pip install "remat-pass\[plot\]"'):
        plot_pareto(curve, tmp_path / "pareto.png")


def test_hull_is_a_lower_bound_under_the_exact_curve(traced, curve):
    """The fast planner's hull (the whole curve at once) and the ILP's named budgets: one curve, one
    point type; every exact point lies on or above the hull, and the hull ends at keep-all."""
    with_hull = sweep_traced(traced, (0.5,), baselines=(), progress=False, hull=True)
    hull = with_hull.hull
    assert hull and all(p.status == "hull_vertex" and p.feasible and p.plan is None for p in hull)
    kept = [p.kept_bytes for p in hull]
    assert kept == sorted(kept) and kept[-1] == KEEP_ALL and hull[-1].recompute_seconds == 0
    assert SMALLEST <= kept[0]
    for point in (p for p in curve.points if p.feasible):
        left = [v for v in hull if v.kept_bytes <= point.kept_bytes]
        right = [v for v in hull if v.kept_bytes >= point.kept_bytes]
        if not left or not right:
            continue
        a, b = left[-1], right[0]
        t = 0.0 if b.kept_bytes == a.kept_bytes else (point.kept_bytes - a.kept_bytes) / (b.kept_bytes - a.kept_bytes)
        bound = a.recompute_seconds + t * (b.recompute_seconds - a.recompute_seconds)
        assert point.recompute_seconds >= bound * (1 - 1e-9) - 1e-15
    assert with_hull.to_dict()["hull"][0]["status"] == "hull_vertex"
