"""The simulator-judged local search (``solvers.peak.local_search``): never over budget, never costlier,
and it finds what per-block checkpointing leaves on the table; its repair makes plans that
overshoot fit by giving up kept values."""

from __future__ import annotations

import random
import time
from itertools import combinations

import pytest
import torch

from remat_pass.solvers import baselines
from remat_pass.solvers.analysis.graph_facts import relevant_values
from remat_pass.solvers.peak.local_search import improve, repair
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.problem import Plan, Problem, closure_from_keep_set

from .models import make_case
from .test_solvers import transformer


def _every_closure(problem: Problem) -> tuple[list[tuple[frozenset[int], frozenset[int]]], list[int]]:
    """Every keep set's (kept, recomputed) closure, in a fixed order, and five budgets spread over
    their distinct simulated peaks."""
    keepable = sorted(v for v in relevant_values(problem) if problem.values[v].keepable)
    plans = sorted({closure_from_keep_set(problem, keep) for size in range(len(keepable) + 1)
                    for keep in combinations(keepable, size)}, key=lambda p: (sorted(p[0]), sorted(p[1])))
    peaks = sorted({simulate_plan(problem, Plan(problem, k, r, "x")).peak_bytes for k, r in plans})
    return plans, peaks[:: max(len(peaks) // 4, 1)]


def test_from_every_plan_that_fits_the_result_fits_and_is_no_costlier():
    problem = transformer()
    plans, budgets = _every_closure(problem)
    sample = random.Random(0).sample(plans, min(40, len(plans)))
    for budget in budgets:
        for kept, recomputed in sample:
            plan = Plan(problem, kept, recomputed, "brute")
            if simulate_plan(problem, plan).peak_bytes > budget:
                continue
            better = improve(problem, plan, budget, time.perf_counter() + 5)
            assert simulate_plan(problem, better).peak_bytes <= budget
            assert better.recompute_seconds <= plan.recompute_seconds


@pytest.fixture(scope="module")
def gpt_at_per_blocks_peak() -> tuple[Problem, Plan, int]:
    """The GPT case's step (FLOP-priced), per-block checkpointing's plan, and its simulated peak."""
    from remat_pass.planning.pipeline import trace_step

    torch._dynamo.reset()
    model, inputs, loss = make_case("gpt")
    problem = trace_step(model, inputs, loss_fn=loss, device="cpu", costs="flops").problem
    torch._dynamo.reset()
    decision = baselines.per_block(problem)
    per_block = Plan(problem, decision.kept, decision.recomputed, "per_block")
    return problem, per_block, simulate_plan(problem, per_block).peak_bytes


def test_it_beats_per_block_checkpointing_at_its_own_peak(gpt_at_per_blocks_peak):
    problem, per_block, budget = gpt_at_per_blocks_peak
    better = improve(problem, per_block, budget, time.perf_counter() + 30)
    assert simulate_plan(problem, better).peak_bytes <= budget
    assert better.recompute_seconds < 0.95 * per_block.recompute_seconds


def test_a_repaired_plan_fits_and_a_plan_that_fits_is_left_alone():
    problem = transformer()
    plans, budgets = _every_closure(problem)
    repaired = 0
    for budget in budgets:
        for kept, recomputed in random.Random(1).sample(plans, min(40, len(plans))):
            plan = Plan(problem, kept, recomputed, "brute")
            found = repair(problem, plan, budget, time.perf_counter() + 5)
            if simulate_plan(problem, plan).peak_bytes <= budget:
                assert found is not None and found[0] is plan
                continue
            if found is not None:
                repaired += 1
                assert found[1].peak_bytes <= budget
                assert simulate_plan(problem, found[0]).peak_bytes == found[1].peak_bytes
                assert found[0].recompute_seconds >= plan.recompute_seconds
    assert repaired > 0


def test_repair_makes_keep_all_fit_per_block_checkpointings_peak(gpt_at_per_blocks_peak):
    problem, _, budget = gpt_at_per_blocks_peak
    keep_all = baselines.keep_all(problem)
    keep_all = Plan(problem, keep_all.kept, keep_all.recomputed, "keep_all")
    assert simulate_plan(problem, keep_all).peak_bytes > budget
    found = repair(problem, keep_all, budget, time.perf_counter() + 60)
    assert found is not None
    assert found[1].peak_bytes <= budget and simulate_plan(problem, found[0]).peak_bytes <= budget
