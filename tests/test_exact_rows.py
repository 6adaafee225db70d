"""The exact peak rows (``solvers.peak.exact_rows``): every plan that fits satisfies them (so the peak
planner's bound stays a proven lower bound), and at an op they count exactly what the simulator
holds (so they are as tight as the schedule allows)."""

from __future__ import annotations

import random

import pytest

from remat_pass.solvers import baselines
from remat_pass.solvers.mip import cpsat
from remat_pass.solvers.analysis.graph_facts import relevant_values
from remat_pass.solvers.mip.backend_run import model_rows
from remat_pass.solvers.mip.solve import run_mip
from remat_pass.solvers.mip.keep_model import Rounding, build, rounding_for, time_weights
from remat_pass.solvers.peak.exact_rows import ExactRowPlaces, ExactStepRows
from remat_pass.solvers.analysis.memory import second_tensors, simulate_plan
from remat_pass.solvers.analysis.lifetimes import backward_lifetimes, backward_steps_of
from remat_pass.solvers.problem import Plan, Problem, closure_from_keep_set


def _plans(problem: Problem, count: int, seed: int = 0) -> list[Plan]:
    """The baselines and random keep-set closures: plans of every shape."""
    rng = random.Random(seed)
    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    plans = [Plan(problem, p.kept, p.recomputed, "baseline") for p in baselines.heuristic_plans(problem)]
    for _ in range(count):
        share = rng.choice((0.1, 0.4, 0.8))
        kept, recomputed = closure_from_keep_set(problem, [v for v in keepable if rng.random() < share])
        plans.append(Plan(problem, kept, recomputed, "random"))
    return plans


def _rows_admit(problem: Problem, plan: Plan, budget: int, rows: ExactStepRows) -> bool:
    """Whether the model with these rows, its choices fixed to ``plan``'s, has a solution."""
    model = build(problem, rows.rounding, None, time_weights(problem)[0])
    rows.add(model)
    for v, variable in model.keep.items():
        variable.lowBound = variable.upBound = int(v in plan.kept)
    for v, variable in model.recompute.items():
        variable.lowBound = variable.upBound = int(v in plan.recomputed)
    status = run_mip(model.lp, backend="highs", time_limit=60).status
    assert status in ("optimal", "infeasible"), status
    return status == "optimal"


def _check_plans(problem: Problem, count: int, every_step: bool) -> None:
    """Rows at the plan's peak step and a sample of others (``every_step``: all of them)."""
    exact = Rounding(quantum=1, storage_bytes=rounding_for(problem).storage_bytes, up=False)
    rng = random.Random(1)
    total = len(backward_steps_of(problem))
    tight = 0
    for plan in _plans(problem, count):
        memory = simulate_plan(problem, plan)
        events = backward_lifetimes(problem, plan)[0]
        peak_step = events[memory.peak_index].step
        sample = range(total) if every_step else rng.sample(range(total), min(12, total))
        steps = tuple(sorted({peak_step, *sample}))
        made = tuple((e.step, e.value) for e in events if e.value is not None and (every_step or e.step in steps))
        elsewhere = tuple((rng.randrange(total), rng.randrange(len(problem.values))) for _ in range(8))
        budget = memory.backward_peak

        def rows(at: int) -> ExactStepRows:
            return ExactStepRows(problem, at, exact, steps=steps, events=made + elsewhere)

        assert _rows_admit(problem, plan, budget, rows(budget)), plan.solver  # valid: the bound stays a bound
        at_op = events[memory.peak_index].value is None and memory.peak_phase == "backward"
        pinned = {problem.values[i].storage for i in problem.forward_outputs}
        if at_op and not second_tensors(problem, plan, pinned):
            assert not _rows_admit(problem, plan, budget - 1, rows(budget - 1)), plan.solver  # exact there
            tight += 1
    assert tight >= 2  # the exactness claim was exercised


def test_every_plan_satisfies_the_rows_at_its_peak_and_an_op_peak_is_counted_exactly(gpt_step):
    _check_plans(gpt_step, 4, every_step=False)


@pytest.mark.slow
def test_the_same_with_rows_at_every_step_on_more_plans(gpt_step):
    _check_plans(gpt_step, 12, every_step=True)


@pytest.mark.skipif(not cpsat.available(), reason="OR-Tools is not installed")
def test_cpsat_and_highs_agree_on_an_exact_round(gpt_step):
    """The CP-SAT translation (``solvers.mip.cpsat``) of a real exact round: its solution satisfies
    every row of the PuLP model, its bound is below HiGHS's solution and HiGHS's bound below its
    solution, and where both prove an optimum it is the same one."""
    problem = gpt_step
    per_block = Plan(problem, *(lambda p: (p.kept, p.recomputed))(baselines.per_block(problem)), "per_block")
    memory = simulate_plan(problem, per_block)
    peak_step = backward_lifetimes(problem, per_block)[0][memory.peak_index].step
    relaxed = rounding_for(problem).optimistic()
    weights, _ = time_weights(problem)
    results = {}
    for backend in ("cpsat", "highs"):
        model = build(problem, relaxed, None, weights)
        ExactStepRows(problem, memory.peak_bytes, relaxed, steps=(peak_step,)).add(model)
        results[backend] = run_mip(model.lp, backend=backend, time_limit=60)
        if backend == "cpsat":
            for var in model.lp.variables():
                var.varValue = results[backend].values[var.name]
            assert all(row.valid(1e-9) for row in model_rows(model.lp))
    cp, highs = results["cpsat"], results["highs"]
    assert cp.status in ("optimal", "feasible") and highs.status in ("optimal", "feasible")
    assert cp.bound <= highs.objective * (1 + 1e-9) and highs.bound <= cp.objective * (1 + 1e-9)
    if highs.status == "optimal" and cp.bound >= cp.objective * (1 - 1e-9):
        assert cp.objective == pytest.approx(highs.objective, rel=1e-9)


def test_rows_go_where_a_plan_overshoots_highest_first_and_never_twice(gpt_step):
    """``ExactRowPlaces.add_where``: the peak first, then (a row being there already, which a
    second tensor can leave overshooting) the next highest place over the budget, each once."""
    problem = gpt_step
    plan = Plan(problem, *(lambda p: (p.kept, p.recomputed))(baselines.per_block(problem)), "per_block")
    memory = simulate_plan(problem, plan)
    budget = memory.peak_bytes - memory.peak_bytes // 20
    events = backward_lifetimes(problem, plan)[0]
    over = sorted((live for live in memory.backward_live if live > budget), reverse=True)
    places = ExactRowPlaces(problem)
    assert places.add_where(plan, memory, budget)
    first = events[memory.peak_index]
    assert (first.step in places.steps) if first.value is None else ((first.step, first.value) in places.events)
    added = 1
    while places.add_where(plan, memory, budget):
        added += 1
    distinct = {(e.step, e.value) for e, live in zip(events, memory.backward_live) if live > budget}
    assert over and added == len(distinct) + len(places.forward_at) and len(distinct) > 1
    assert not places.add_where(plan, memory, budget)
