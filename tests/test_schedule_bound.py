"""The any-schedule lower bound (``solvers.peak.schedule_bound``): never above a plan that fits,
refreshed plans included, and what gives a refreshed plan of ``ilp_peak`` its gap."""

from __future__ import annotations

import dataclasses
import random
from itertools import chain, combinations

import pytest

from remat_pass.solvers import baselines, solve
from remat_pass.solvers.mip import cpsat
from remat_pass.solvers.analysis.graph_facts import relevant_values
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.problem import BackwardStep, Plan, Problem, Value, closure_from_keep_set
from remat_pass.solvers.peak.multiple_recompute import refreshable_storages
from remat_pass.solvers.peak.schedule_bound import any_schedule_bound, bound_steps, fixed_step_bytes

from .test_refresh import _chain
from .test_solvers import transformer

BACKENDS = ["highs", pytest.param("cpsat", marks=pytest.mark.skipif(not cpsat.available(),
                                                                   reason="OR-Tools is not installed"))]


def _subsets(items: list[int]):
    return chain.from_iterable(combinations(items, n) for n in range(len(items) + 1))


def _every_plan(problem: Problem) -> list[tuple[int, float]]:
    """(simulated peak, recompute seconds) of every keep-set closure, as it is and with its
    refreshable storages refreshed one at a time and all together."""
    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    seen, found = set(), []
    for keep in _subsets(keepable):
        kept, recomputed = closure_from_keep_set(problem, keep)
        if (kept, recomputed) in seen:
            continue
        seen.add((kept, recomputed))
        plan = Plan(problem, kept, recomputed, "brute")
        storages = refreshable_storages(problem, plan)
        # none, each alone, and all: every set would be 580,000 plans (four minutes) here
        for chosen in {(), tuple(storages), *((s,) for s in storages)}:
            refreshed = dataclasses.replace(plan, refreshed=frozenset().union(*(storages[s] for s in chosen)))
            found.append((simulate_plan(problem, refreshed).peak_bytes, refreshed.recompute_seconds))
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_bound_never_exceeds_a_plan_that_fits(backend):
    """Brute force on the two-block transformer of the solver tests, every budget from below the
    lowest peak to keep-all's: the bound is at most the cheapest plan that fits (refreshed or
    not), with rows at every step or at a few; below every plan's peak it may say infinite."""
    problem = transformer()
    plans = _every_plan(problem)
    lowest, highest = min(p for p, _ in plans), max(p for p, _ in plans)
    steps = len(fixed_step_bytes(problem))
    for budget in sorted({lowest - 1, *range(lowest, highest + 1, max((highest - lowest) // 10, 1)), highest}):
        cheapest = min((seconds for peak, seconds in plans if peak <= budget), default=float("inf"))
        for count in (steps, 3):
            bound = any_schedule_bound(problem, budget, backend=backend, time_limit=30, steps=count).seconds
            assert bound is not None and bound <= cheapest + 1e-9, (budget, count, bound, cheapest)
    free = any_schedule_bound(problem, highest, backend=backend, time_limit=30, steps=steps)
    assert free.seconds == pytest.approx(0.0, abs=1e-9)  # keep-all fits: nothing need be recomputed


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_bound_sees_what_plans_cannot_do(backend):
    """On the refresh chain at 16 bytes (the working set alone at step 2), the cheapest plan
    keeps ``b`` and refreshes ``a`` (made for step 0 and again for step 4): 2 s. A schedule that
    keeps ``a`` as well for step 0 and makes it once, for step 4, needs 1 s (the rewrite cannot
    both keep and recompute a value); the bound is exactly that."""
    problem = _chain()
    assert any_schedule_bound(problem, 16, backend=backend, time_limit=30).seconds == pytest.approx(1.0)
    assert any_schedule_bound(problem, 15, backend=backend, time_limit=30).seconds == float("inf")


def _tuple_chain() -> Problem:
    """x -> t, a two-output op (a tuple: no storage of its own, 2 s) -> g, its element (8 B);
    backward reads g at steps 0 and 2, and step 1 has a 16-byte working set."""
    values = (
        Value(0, "x", (), storage=0, available=True),
        Value(1, "t", (0,), storage=2, recompute_seconds=2.0, flops=4, keepable=False, op="native_layer_norm.default"),
        Value(2, "g", (1,), storage=1, op="getitem"),
    )
    steps = (BackwardStep((2,)), BackwardStep((), 16), BackwardStep((2,)))
    return Problem(values, (0, 8, 0), frozenset({2}), backward_steps=steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_element_of_a_tuple_is_made_again_only_by_running_its_op(backend):
    """At 16 bytes ``g`` cannot live across step 1. The cheapest schedule holds ``g`` from the
    forward for step 0 and runs ``t`` again for step 2: 2 s. The bound used to count the tuple
    alive at step 1 for free (it has no bytes) and take ``g`` from it afterwards, also for free: 0 s."""
    problem = _tuple_chain()
    assert any_schedule_bound(problem, 16, backend=backend, time_limit=30).seconds == pytest.approx(2.0)
    assert any_schedule_bound(problem, 24, backend=backend, time_limit=30).seconds == pytest.approx(0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_a_traced_step_the_bound_never_exceeds_a_plan_that_fits(gpt_step, backend):
    """The two-layer GPT's step (layer-norm tuples, a split attention, replayed dropout): at
    per-block checkpointing's peak and two looser budgets, the bound is at most every sampled
    plan that fits, each keep-set closure as it is and with all its refreshable storages refreshed."""
    problem = gpt_step
    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    plans = [baselines.per_block(problem)]
    rng = random.Random(0)
    for _ in range(150):
        plans.append(Plan(problem, *closure_from_keep_set(problem, rng.sample(keepable, rng.randrange(len(keepable)))),
                          "sample"))
    plans += [dataclasses.replace(plan, refreshed=frozenset().union(*refreshable_storages(problem, plan).values()))
              for plan in plans[1:]]
    priced = [(simulate_plan(problem, plan).peak_bytes, plan.recompute_seconds) for plan in plans]
    lowest = priced[0][0]
    highest = max(p for p, _ in priced)
    for budget in (lowest, lowest + (highest - lowest) // 8, lowest + (highest - lowest) // 2):
        cheapest = min(seconds for peak, seconds in priced if peak <= budget)
        bound = any_schedule_bound(problem, budget, backend=backend, time_limit=60).seconds
        assert bound is not None and bound <= cheapest * (1 + 1e-9), (budget, bound, cheapest)


def test_a_refreshed_plan_carries_the_any_schedule_gap():
    """ilp_peak's answer on the chain is the refreshed plan: its gap is against the any-schedule
    bound, 1 s (was None: the planner's own rows do not bound refreshed plans)."""
    decision = solve(_chain(), 16, solver="ilp_peak", time_limit=20)
    assert decision.kept == {2} and decision.refreshed == {1}
    assert decision.recompute_seconds == pytest.approx(2.0)
    assert str(decision.status) == "feasible" and decision.gap == pytest.approx(0.5)


def test_the_steps_with_rows_are_where_fixed_memory_is_highest():
    problem = _chain()
    assert fixed_step_bytes(problem) == [8, 8, 16, 0, 8]
    assert bound_steps(problem, 2) == [0, 2] and bound_steps(problem, 10) == [0, 1, 2, 3, 4]


def test_the_benchmarks_flop_bound_never_exceeds_a_plan_that_fits():
    """``benchmarks.vs_checkpoint.any_schedule_flops`` prices the step by FLOPs alone: at every
    budget its bound is at most the FLOPs of the plan that recomputes fewest and fits."""
    from benchmarks.vs_checkpoint import any_schedule_flops

    base = transformer()
    problem = dataclasses.replace(base, values=tuple(
        dataclasses.replace(value, flops=round(value.recompute_seconds * 1e6) + 7 * i)
        for i, value in enumerate(base.values)))
    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    plans = []
    for keep in _subsets(keepable):
        plan = Plan(problem, *closure_from_keep_set(problem, keep), "brute")
        plans.append((simulate_plan(problem, plan).peak_bytes, plan.recompute_flops))
    lowest, highest = min(p for p, _ in plans), max(p for p, _ in plans)
    bounds = []
    for budget in range(lowest, highest + 1, max((highest - lowest) // 5, 1)):
        fewest = min(flops for peak, flops in plans if peak <= budget)
        bound = any_schedule_flops(problem, budget, seconds=30)
        assert bound is not None and bound <= fewest, (budget, bound, fewest)
        bounds.append(bound)
    assert bounds[0] > 0  # at the lowest peak something must be recomputed: the bound says so


def test_the_bound_keeps_to_its_time_limit():
    """Out of time, building its model or solving it, the bound proves nothing (None), and the
    planner's answer's bound is not started with too little time left (a second, or its share per
    value): the planner's limit is the whole planning time."""
    import time

    from remat_pass.solvers.peak import schedule_bound
    from remat_pass.solvers.peak.schedule_bound import any_schedule_bound_by

    late = any_schedule_bound(transformer(), 10**9, backend="highs", time_limit=0.0)
    assert late.seconds is None and late.status == "time_limit"
    assert any_schedule_bound_by(_chain(), 16, backend="highs", deadline=time.perf_counter()) is None
    with pytest.MonkeyPatch.context() as patch:  # not started with less than its per-value share left either
        patch.setattr(schedule_bound, "ANSWER_BOUND_SECONDS_PER_VALUE", 1.0)  # 3 s for the chain's 3 values
        assert any_schedule_bound_by(_chain(), 16, backend="highs", deadline=time.perf_counter() + 2) is None
    assert any_schedule_bound_by(_chain(), 16, backend="highs", deadline=time.perf_counter() + 20) == pytest.approx(1.0)


def test_the_answers_any_schedule_bound_is_the_best_of_a_quick_and_a_full_model(monkeypatch):
    """``any_schedule_bound_by`` solves rows at a few steps first (a bound within a short reserve on
    deep models), then at the default steps, and keeps the higher bound. On the two-block
    transformer at 0.9 of per-block's peak, rows at 2 steps bound 3 s and at all steps 4 s."""
    import time

    from remat_pass.solvers.peak import schedule_bound
    from remat_pass.solvers.analysis.memory import simulate_plan as simulate

    problem = transformer()
    budget = int(0.9 * simulate(problem, solve(problem, None, solver="per_block")).peak_bytes)
    quick, full = (any_schedule_bound(problem, budget, backend="highs", time_limit=30, steps=count).seconds
                   for count in (2, schedule_bound.DEFAULT_STEPS))
    assert quick == pytest.approx(3.0) and full == pytest.approx(4.0)
    monkeypatch.setattr(schedule_bound, "QUICK_BOUND_STEPS", 2)
    asked = []
    solve_at = schedule_bound.any_schedule_bound

    def recorded(*args, steps, **kwargs):
        asked.append(steps)
        return solve_at(*args, steps=steps, **kwargs)

    monkeypatch.setattr(schedule_bound, "any_schedule_bound", recorded)
    found = schedule_bound.any_schedule_bound_by(problem, budget, backend="highs", deadline=time.perf_counter() + 60)
    assert asked == [2, schedule_bound.DEFAULT_STEPS] and found == pytest.approx(4.0)


def test_the_saved_bytes_floor_never_exceeds_a_plan_that_fits():
    """``saved_bytes_floor`` (what the peak planner's gap rests on without proof work): brute force
    on the two-block transformer, refreshed plans included, every budget from the lowest peak to
    keep-all's: at most the cheapest plan that fits, and that plan's own cost at some budget."""
    import time

    from remat_pass.solvers.peak.schedule_bound import FLOOR_HULL_SECONDS, saved_bytes_floor

    problem = transformer()
    plans = _every_plan(problem)
    lowest, highest = min(p for p, _ in plans), max(p for p, _ in plans)
    tight = 0
    for budget in sorted({*range(lowest, highest + 1, max((highest - lowest) // 10, 1)), highest}):
        cheapest = min(seconds for peak, seconds in plans if peak <= budget)
        floor = saved_bytes_floor(problem, budget, time.perf_counter() + 10)
        assert floor is not None and floor <= cheapest * (1 + 1e-9), (budget, floor, cheapest)
        tight += floor >= cheapest * (1 - 1e-9)
    assert tight >= 1
    # No time left: the hull's bound still comes (an answer without a gap would drop quality silently),
    # within its own short allowance, and still bounds every plan.
    began = time.perf_counter()
    late = saved_bytes_floor(problem, highest, began)
    assert late is not None and late <= min(seconds for _, seconds in plans) * (1 + 1e-9)
    assert time.perf_counter() - began <= FLOOR_HULL_SECONDS + 0.5
