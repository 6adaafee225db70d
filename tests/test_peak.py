"""Peak memory: the simulators against each other and against the allocator; peak budgets kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import solvers
from remat_pass import BudgetInfeasibleError
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.examples import GPTConfig
from remat_pass.runtime.measure import peak_activation_bytes
from remat_pass.rewrite.rewrite import rewrite
from remat_pass.rewrite.simulate import simulate
from remat_pass.solvers.analysis.memory import simulate_plan

from .models import GPTWithLoss
from .helpers import assert_same_step, eager_reference, run_step


def _case(seed: int = 0):
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=128, seq_len=64, layers=3, hidden=64, heads=4, dropout=0.1)
    model = GPTWithLoss(config)
    tokens = torch.randint(0, 128, (2, 64))
    targets = torch.randint(0, 128, (2, 64))
    return model, (tokens, targets), (lambda loss, *_: loss)


@pytest.fixture(scope="module")
def traced():
    model, inputs, _ = _case()
    (joint,) = capture(model, inputs)
    return model, inputs, annotate(joint)


PLANS = [("keep_all", None), ("ilp", 0.5), ("ilp", 0.25), ("recompute_all", None), ("per_block", None)]


@pytest.mark.parametrize("solver, fraction", PLANS)
def test_plan_level_simulation_matches_the_graphs(traced, solver, fraction):
    _, _, annotated = traced
    problem = annotated.problem
    budget = None if fraction is None else int(fraction * problem.keep_all_bytes())
    plan = solvers.solve(problem, budget, solver=solver)
    graph_peak = simulate(*rewrite(annotated, plan)).peak_bytes
    plan_peak = simulate_plan(problem, plan).peak_bytes
    assert abs(plan_peak - graph_peak) <= 0.01 * graph_peak


def test_saved_bytes_are_not_the_peak(traced):
    """Why the peak needs its own model: recomputing everything can peak as high as keeping all."""
    _, _, annotated = traced
    problem = annotated.problem
    keep_all = simulate_plan(problem, solvers.solve(problem, solver="keep_all"))
    least = solvers.solve(problem, solver="recompute_all")
    assert least.kept_bytes < 0.2 * problem.keep_all_bytes()
    assert simulate_plan(problem, least).peak_bytes > 0.8 * keep_all.peak_bytes


@pytest.mark.parametrize("kind, budget", [("peak", 0.6), ("peak", 0.4), ("auto", "absolute")])
def test_peak_budget_is_kept_and_predicted_within_5_percent(kind, budget):
    model, inputs, loss_fn = _case()
    expected = eager_reference(model, inputs, loss_fn)
    probe = remat_pass.optimize(model, budget=1.0, example_inputs=inputs)
    keep_all_peak = probe.plan.predicted_peak_bytes
    if budget == "absolute":
        budget = int(0.5 * keep_all_peak)
        limit = budget
    else:
        limit = int(budget * keep_all_peak)
    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, budget=budget, budget_kind=kind, example_inputs=inputs)
    plan = optimized.plan
    assert plan.budget_kind == "peak" and plan.predicted_peak_bytes <= limit
    gradients = [p.grad for p in model.parameters()]
    torch.manual_seed(1234)
    _, measured = peak_activation_bytes(
        lambda: optimized(*inputs).backward(), survivors=lambda: [p.grad for p in model.parameters()]
    )
    assert measured <= limit, f"measured peak {measured} over the {limit}-byte budget"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured
    del gradients
    assert_same_step(run_step(model, optimized, inputs, loss_fn), expected)


def test_infeasible_peak_budget_states_a_minimum_that_works():
    model, inputs, _ = _case()
    with pytest.raises(BudgetInfeasibleError) as raised:
        remat_pass.optimize(model, budget=1024, example_inputs=inputs)
    error = raised.value
    assert error.kind == "peak" and "peak" in str(error)
    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, budget=error.min_bytes, example_inputs=inputs)
    assert optimized.plan.predicted_peak_bytes <= error.min_bytes
    # What that lowest-peaked plan keeps (a later piece of a split step reserves it): at most its peak.
    assert error.lowest_kept_bytes is not None and 0 < error.lowest_kept_bytes <= error.min_bytes


def test_bad_budget_kind_is_rejected():
    with pytest.raises(ValueError, match="budget_kind"):
        remat_pass.optimize(nn.Linear(2, 2), budget=0.5, budget_kind="flops")


def test_peak_planner_on_a_hand_made_chain():
    """x -> a -> b -> c -> d, each 100 bytes, read by backward in reverse order."""
    from remat_pass.solvers.problem import Problem, Value

    x = Value(0, "x", (), storage=0, available=True)
    chain = [Value(i, name, (i - 1,), storage=i, recompute_seconds=1e-3) for i, name in enumerate("abcd", start=1)]
    problem = Problem((x, *chain), (0, 100, 100, 100, 100), frozenset({1, 2, 3, 4}))
    keep_all = simulate_plan(problem, solvers.solve(problem, solver="keep_all"))
    assert keep_all.peak_bytes == 400
    everything = simulate_plan(problem, solvers.solve(problem, solver="recompute_all"))
    assert everything.peak_bytes == 400  # recomputing d first materializes a, b, c and holds them
    plan = solvers.solve(problem, 300, solver="ilp_peak")
    assert plan.budget_kind == "peak" and plan.predicted_peak_bytes <= 300
    assert simulate_plan(problem, plan).peak_bytes == plan.predicted_peak_bytes
    with pytest.raises(BudgetInfeasibleError) as raised:
        solvers.solve(problem, 99, solver="ilp_peak")
    assert raised.value.min_bytes > 99
    fitting = solvers.solve(problem, raised.value.min_bytes, solver="ilp_peak")
    assert fitting.predicted_peak_bytes <= raised.value.min_bytes


def test_the_peak_planner_answers_within_its_time_limit(monkeypatch):
    """``ilp_peak``'s ``time_limit`` is the whole planning time when a plan fits: the searches end
    at its first 80%, the window that makes overshooting plans fit at 90%, a refreshed plan's
    bound at the limit itself (the last two ran up to a fifth past it before, the bound 10 s at
    least). On the refresh chain the answer is a refreshed plan, so every phase runs."""
    import time

    from remat_pass.solvers.peak import planner as peak

    from .test_refresh import _chain

    ends: dict[str, list[float]] = {"search": [], "fit": [], "bound": []}
    fit_cheaper, any_schedule_bound_by, over_saved_cap = peak.fit_cheaper, peak.any_schedule_bound_by, peak._Search.over_saved_cap

    def fit(problem, plans, budget, deadline, repair_kept=True):
        ends["fit"].append(deadline)
        return fit_cheaper(problem, plans, budget, deadline, repair_kept)

    def bound(problem, budget, *, backend, deadline, threads=None):
        ends["bound"].append(deadline)
        return any_schedule_bound_by(problem, budget, backend=backend, deadline=deadline, threads=threads)

    def search(self, *args, **kwargs):
        ends["search"].append(self.deadline)
        return over_saved_cap(self, *args, **kwargs)

    monkeypatch.setattr(peak, "fit_cheaper", fit)
    monkeypatch.setattr(peak, "any_schedule_bound_by", bound)
    monkeypatch.setattr(peak._Search, "over_saved_cap", search)
    limit, called = 20.0, time.perf_counter()
    decision = solvers.solve(_chain(), 16, solver="ilp_peak", time_limit=limit)
    assert decision.refreshed and decision.gap is not None  # the bound had time: the chain is tiny
    assert all(ends.values()), ends
    slack = 1.0  # between ``called`` and the planner's own clock
    assert max(ends["search"]) <= called + 0.8 * limit + slack
    assert max(ends["fit"]) <= called + 0.9 * limit + slack
    assert max(ends["bound"]) <= called + limit + slack


def test_a_budget_no_plan_fits_within_the_limit_is_searched_on_before_it_is_refused(monkeypatch):
    """``refusal_time_limit``: where the searches find nothing that fits by ``time_limit`` (here the
    first run of them is made to find nothing), they run again, to the longer limit, before the
    budget is refused; the second run finds the plan. A budget nothing fits is still refused, after
    both runs, with a minimum that works; a plan found in time never waits for the second run."""
    from remat_pass.solvers.peak import planner as peak
    from remat_pass.solvers.problem import Problem, Value

    x = Value(0, "x", (), storage=0, available=True)
    chain = [Value(i, name, (i - 1,), storage=i, recompute_seconds=1e-3) for i, name in enumerate("abcd", start=1)]
    problem = Problem((x, *chain), (0, 100, 100, 100, 100), frozenset({1, 2, 3, 4}))
    runs: list[tuple[float, float]] = []
    run = peak._Search.run

    def first_finds_nothing(self, keep_all_memory, began, time_limit, *args):
        runs.append((time_limit, self.deadline - began))
        return None if len(runs) == 1 else run(self, keep_all_memory, began, time_limit, *args)

    monkeypatch.setattr(peak._Search, "run", first_finds_nothing)
    plan = solvers.solve(problem, 250, solver="ilp_peak", time_limit=2, prove=False, refusal_time_limit=6)
    assert plan.predicted_peak_bytes <= 250  # no baseline fits (checkpointing every other value peaks at 300)
    assert [limit for limit, _ in runs] == [2, 6]
    assert runs[1][1] == pytest.approx(6 * (1 - peak.FIT_SHARE - peak.SAVED_FLOOR_SHARE), abs=0.05)
    runs.clear()
    with pytest.raises(BudgetInfeasibleError) as raised:
        solvers.solve(problem, 99, solver="ilp_peak", time_limit=2, prove=False, refusal_time_limit=3)
    assert [limit for limit, _ in runs] == [2, 3] and raised.value.min_bytes > 99
    monkeypatch.setattr(peak._Search, "run", lambda self, *args: runs.append(args) or run(self, *args))
    runs.clear()
    assert solvers.solve(problem, 250, solver="ilp_peak", time_limit=2, prove=False,
                         refusal_time_limit=6).predicted_peak_bytes <= 250
    assert len(runs) == 1


def test_an_answer_the_rows_do_not_prove_gets_the_any_schedule_bound_too(monkeypatch):
    """On the two-block transformer at per-block's peak the rows' bound leaves the answer 50% open.
    The any-schedule bound is asked for then, and where it is higher it is the one that counts (here
    a stand-in at the answer's own cost makes it optimal); without a bound from it the rows' gap
    stands. With offload allowed it is not asked: it bounds recompute schedules only."""
    from remat_pass.solvers.peak import planner as peak

    from .test_solvers import transformer

    problem = transformer()
    budget = simulate_plan(problem, solvers.solve(problem, None, solver="per_block")).peak_bytes
    asked: list[float] = []
    for floor, status, gap in ((None, "feasible", 0.5), (6.0, "optimal", 0.0)):
        monkeypatch.setattr(peak, "any_schedule_bound_by", lambda *args, floor=floor, **kwargs: asked.append(1) or floor)
        decision = solvers.solve(problem, budget, solver="ilp_peak", time_limit=10)
        assert not decision.refreshed and decision.recompute_seconds == pytest.approx(6.0)
        assert (str(decision.status), decision.gap) == (status, pytest.approx(gap))
    assert len(asked) == 2
    solvers.solve(problem, budget, solver="ilp_peak", time_limit=10, cap_solver="ilp_offload")
    assert len(asked) == 2


def test_without_proof_work_no_exact_rows_and_no_any_schedule_bound(monkeypatch):
    """``prove=False`` (what ``optimize`` runs by default): the exact rows and the any-schedule bound
    are not run, no time is kept for them, and the answer claims only what the rows' relaxation
    proved: on the two-block transformer at per-block's peak, the same plan, its 50% gap, not 'optimal'."""
    from remat_pass.solvers.peak import planner as peak

    from .test_solvers import transformer

    problem = transformer()
    budget = simulate_plan(problem, solvers.solve(problem, None, solver="per_block")).peak_bytes
    ran: list[str] = []
    monkeypatch.setattr(peak, "any_schedule_bound_by", lambda *args, **kwargs: ran.append("bound") or 6.0)
    exact_rounds = peak._Search.exact_rounds
    monkeypatch.setattr(peak._Search, "exact_rounds",
                        lambda self, *args: ran.append("exact") or exact_rounds(self, *args))
    fast = solvers.solve(problem, budget, solver="ilp_peak", time_limit=10, prove=False)
    assert ran == []
    assert not fast.refreshed and fast.recompute_seconds == pytest.approx(6.0)
    assert (str(fast.status), fast.gap) == ("feasible", pytest.approx(0.5))
    proven = solvers.solve(problem, budget, solver="ilp_peak", time_limit=10)
    assert ran == ["exact", "bound"] and str(proven.status) == "optimal"


def test_the_refusal_probe_is_solved_once_per_problem(monkeypatch):
    """The Inductor fit refuses several budgets of one graph; the probe behind each refusal's
    minimum (up to ten saved-bytes caps) is the same for every budget, so it is solved once per
    problem and settings, and an equal problem built again (the fit traces each candidate anew)
    reuses it, its plans rebuilt on that problem."""
    from remat_pass.solvers.peak import cap_search
    from remat_pass.solvers.problem import Problem, Value

    monkeypatch.setattr(cap_search, "_PROBED", cap_search.OrderedDict())
    probed = []
    solve_probe = cap_search.CapSearch._probed
    monkeypatch.setattr(cap_search.CapSearch, "_probed", lambda self, f: probed.append(f) or solve_probe(self, f))

    def chain() -> Problem:
        x = Value(0, "x", (), storage=0, available=True)
        values = [Value(i, name, (i - 1,), storage=i, recompute_seconds=1e-3) for i, name in enumerate("abcd", start=1)]
        return Problem((x, *values), (0, 100, 100, 100, 100), frozenset({1, 2, 3, 4}))

    minimums = []
    for budget in (99, 120, 90):
        with pytest.raises(BudgetInfeasibleError) as raised:
            solvers.solve(chain(), budget, solver="ilp_peak", time_limit=1, prove=False)
        minimums.append(raised.value.min_bytes)
    assert len(probed) == 1
    assert len(set(minimums)) == 1 and minimums[0] > 120
    problem = chain()
    plan = solvers.solve(problem, minimums[0], solver="ilp_peak", time_limit=1, prove=False)
    assert plan.problem is problem and plan.predicted_peak_bytes <= minimums[0]


def test_a_caller_that_only_moves_on_can_skip_the_refusal_probe(monkeypatch):
    """``probe_minimum=False`` (the Inductor fit's re-asked candidates): a refusal states the
    lowest peak of the plans the search tried, without probing the trade-off curve."""
    from remat_pass.solvers.peak import cap_search
    from remat_pass.solvers.problem import Problem, Value

    monkeypatch.setattr(cap_search, "_PROBED", cap_search.OrderedDict())
    probed = []
    monkeypatch.setattr(cap_search.CapSearch, "_probed", lambda self, f: probed.append(f) or [])
    x = Value(0, "x", (), storage=0, available=True)
    values = [Value(i, name, (i - 1,), storage=i, recompute_seconds=1e-3) for i, name in enumerate("abcd", start=1)]
    problem = Problem((x, *values), (0, 100, 100, 100, 100), frozenset({1, 2, 3, 4}))
    with pytest.raises(BudgetInfeasibleError) as raised:
        solvers.solve(problem, 99, solver="ilp_peak", time_limit=1, prove=False, probe_minimum=False)
    assert not probed and raised.value.kind == "peak" and raised.value.min_bytes > 99
