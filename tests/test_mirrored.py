"""Block-mirrored plans (``solvers.peak.mirrored_blocks``): identical blocks tied in the peak rows' MIP."""

from __future__ import annotations

import pytest

from remat_pass.solvers import baselines
from remat_pass.solvers.mip.keep_model import build, rounding_for, weights_for
from remat_pass.solvers.mip.run_keep import solve_once
from remat_pass.solvers.fast.blocks import decompose
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.analysis.lifetimes import backward_steps_of
from remat_pass.solvers.peak.mirrored_blocks import MIN_BLOCKS, MirroredRows, mirrored_pairs, shadowed_steps
from remat_pass.solvers.peak.rows import PeakRows
from remat_pass.solvers.problem import Plan

from .test_fast_solver import random_problem


@pytest.mark.parametrize("seed", range(6))
def test_every_block_but_the_last_takes_the_first_ones_choices_position_by_position(seed):
    problem = random_problem(seed, blocks=5)
    split = decompose(problem)
    pairs = set(mirrored_pairs(problem))
    expected = set()
    for members in split.classes:
        groups = [split.groups[g] for g in members]
        if len(groups) >= MIN_BLOCKS:
            expected |= {(a, b) for group in groups[1:-1] for a, b in zip(groups[0].members, group.members)}
            assert not {v for pair in pairs for v in pair} & set(groups[-1].members)  # the last block is free
    assert pairs == expected and pairs
    for a, b in pairs:
        first, other = problem.values[a], problem.values[b]
        assert (first.op, first.recompute_seconds, first.keepable) == (other.op, other.recompute_seconds, other.keepable)
        assert problem.storage_bytes[first.storage] == problem.storage_bytes[other.storage]


def test_fewer_identical_blocks_than_the_minimum_are_not_tied():
    assert mirrored_pairs(random_problem(1, blocks=MIN_BLOCKS - 1)) == ()
    assert mirrored_pairs(random_problem(1, blocks=0)) == ()
    assert shadowed_steps(random_problem(1, blocks=MIN_BLOCKS - 1)) == frozenset()


@pytest.mark.parametrize("seed", range(6))
def test_the_shadowed_steps_are_the_backward_of_the_tied_copies_before_the_representative(seed):
    """Per class of tied copies, all but the last two are shadowed (the one before the last is the
    representative, the last is free): a step reading only their values is shadowed, a step
    reading a value of any later group is not."""
    problem = random_problem(seed, blocks=5)
    split = decompose(problem)
    shadowed_groups = {g for members in split.classes if len(members) >= MIN_BLOCKS and split.groups[members[0]].is_block
                       for g in members[:-2]}
    assert shadowed_groups
    shadowed = shadowed_steps(problem)
    assert shadowed
    for t, step in enumerate(backward_steps_of(problem)):
        groups = {split.group_of[v] for v in step.reads if v in split.group_of}
        if groups and groups <= shadowed_groups:
            assert t in shadowed
        if any(g > max(shadowed_groups) for g in groups):
            assert t not in shadowed


def test_the_rows_of_skipped_steps_are_left_out():
    problem = random_problem(1, blocks=5)
    rounding, weights = rounding_for(problem), weights_for(problem)

    def step_rows(skipped: frozenset[int]) -> set[str]:
        model = build(problem, rounding, None, weights)
        PeakRows(problem, 10**9, rounding, skipped_steps=skipped).add(model)
        return {name for name in model.lp.constraints if name.startswith("peaki")}

    every = step_rows(frozenset())
    assert step_rows(frozenset(range(len(backward_steps_of(problem))))) == set()
    assert 0 < len(step_rows(shadowed_steps(problem))) < len(every)


# (seed, budget as a fraction of the way from per-block's peak to keep-all's): cases where the step
# rows bind (leaving all of them out lowers the optimum); on the first two, leaving out the
# representative's rows as well changes the optimum too, so a wrong ``shadowed_steps`` fails here.
BINDING_CASES = [(10, 0.25), (10, 0.5), (3, 0.0), (8, 0.0)]


@pytest.mark.parametrize("seed, fraction", BINDING_CASES)
def test_leaving_out_the_shadowed_rows_keeps_the_tied_optimum(seed, fraction):
    """Tied, the representative copy's rows imply the shadowed copies' (they have fewer earlier
    copies' kept values alive): the smaller model has the same optimum."""
    problem = random_problem(seed, blocks=5, size=14)
    pairs, shadowed = mirrored_pairs(problem), shadowed_steps(problem)
    per_block, keep_all = baselines.per_block(problem), baselines.keep_all(problem)
    low = simulate_plan(problem, Plan(problem, per_block.kept, per_block.recomputed, "per_block")).peak_bytes
    high = simulate_plan(problem, Plan(problem, keep_all.kept, keep_all.recomputed, "keep_all")).peak_bytes
    rounding, weights = rounding_for(problem), weights_for(problem)
    rows = PeakRows(problem, int(low + fraction * (high - low)), rounding, transients=True, kept_readers=True)
    every_step = frozenset(range(len(backward_steps_of(problem))))
    solved = [solve_once(problem, None, rounding=rounding, weights=weights, time_limit=20, backend="highs",
                         extension=MirroredRows(rows, pairs, left_out)) for left_out in (frozenset(), shadowed, every_step)]
    assert all(outcome.status == "optimal" for outcome in solved)
    full, pruned, none = (weights.evaluate(outcome.plan) for outcome in solved)
    assert none < full * (1 - 1e-9)  # the step rows bind here
    assert pruned == pytest.approx(full, rel=1e-9)


@pytest.mark.parametrize("seed", [1, 2, 4, 5])
def test_a_mirrored_plan_is_a_valid_plan_alike_in_tied_blocks_and_no_cheaper_than_the_untied_one(seed):
    """A restriction of the same rows: its plan keeps alike what is tied, and the untied MIP
    (which can choose that plan too) is never costlier."""
    problem = random_problem(seed, blocks=5)
    pairs = mirrored_pairs(problem)
    per_block = baselines.per_block(problem)
    keep_all = baselines.keep_all(problem)
    low = simulate_plan(problem, Plan(problem, per_block.kept, per_block.recomputed, "per_block")).peak_bytes
    high = simulate_plan(problem, Plan(problem, keep_all.kept, keep_all.recomputed, "keep_all")).peak_bytes
    rounding, weights = rounding_for(problem), weights_for(problem)
    compared = 0
    for budget in sorted({low, (low + high) // 2, high - 1}):
        rows = PeakRows(problem, budget, rounding, transients=True, kept_readers=True)
        tied = solve_once(problem, None, rounding=rounding, weights=weights, time_limit=20, backend="highs",
                          extension=MirroredRows(rows, pairs))
        free = solve_once(problem, None, rounding=rounding, weights=weights, time_limit=20, backend="highs",
                          extension=rows)
        if tied.plan is None:
            continue
        for a, b in pairs:
            assert (a in tied.plan.kept) == (b in tied.plan.kept)
        simulate_plan(problem, tied.plan)  # a valid plan: the simulator runs it
        assert free.plan is not None and free.status == tied.status == "optimal"
        assert weights.evaluate(free.plan) <= weights.evaluate(tied.plan) * (1 + 1e-9) + 1e-9
        compared += 1
    assert compared > 0


def test_without_proof_work_the_tied_rows_run_where_the_untied_ones_are_out_of_time(monkeypatch):
    """``prove=False`` on a step with more backward steps than the limit's untied rows can take
    (``FAST_ROWS_STEPS_PER_SECOND``, here below any step count): the tied solve still runs, once,
    and its plan is a candidate (its model is about three blocks' at any depth: the 48-layer GPT's
    best plan in 2 s), while the untied relaxation and rows do not; with proof work both run."""
    from remat_pass import solvers
    from remat_pass.solvers.peak import planner as peak

    problem = random_problem(0, blocks=5)
    budget = simulate_plan(problem, baselines.per_block(problem)).peak_bytes  # under keep-all's
    assert mirrored_pairs(problem) and budget < simulate_plan(problem, baselines.keep_all(problem)).peak_bytes
    called: list[str] = []
    mirrored, step_rows = peak._Search.with_mirrored_rows, peak._Search.with_step_rows
    monkeypatch.setattr(peak, "FAST_ROWS_STEPS_PER_SECOND", -1)
    monkeypatch.setattr(peak._Search, "with_mirrored_rows",
                        lambda self, *args: called.append("tied") or mirrored(self, *args))
    monkeypatch.setattr(peak._Search, "with_step_rows",
                        lambda self, *args, **kwargs: called.append("untied") or step_rows(self, *args, **kwargs))
    plan = solvers.solve(problem, budget, solver="ilp_peak", time_limit=5, prove=False)
    assert called == ["tied"] and plan.predicted_peak_bytes <= budget
    called.clear()
    solvers.solve(problem, budget, solver="ilp_peak", time_limit=5, prove=True)
    assert called == ["tied", "untied"]


def test_without_proof_work_a_tied_plan_that_fits_ends_the_searches(monkeypatch):
    """``prove=False``: once the tied rows give a plan that fits, the untied rows, the resumed cap search
    and the overshooting cap's rows are skipped (at 2 s they improved none of nine measured cases, and took
    ~1 s of the 12-layer HF GPT-2's first call). With proof work, or where no tied plan fits, they run."""
    from remat_pass import solvers
    from remat_pass.solvers.peak import planner as peak

    problem = random_problem(0, blocks=5)
    keep_all_peak = simulate_plan(problem, baselines.keep_all(problem)).peak_bytes
    budget = (simulate_plan(problem, baselines.per_block(problem)).peak_bytes + keep_all_peak) // 2
    searches: list[peak._Search] = []
    called: list[str] = []
    init, step_rows, caps = peak._Search.__init__, peak._Search.with_step_rows, peak._Search.over_saved_cap
    monkeypatch.setattr(peak._Search, "__init__", lambda self, *a, **k: searches.append(self) or init(self, *a, **k))
    monkeypatch.setattr(peak._Search, "with_step_rows",
                        lambda self, *a, **k: called.append("untied") or step_rows(self, *a, **k))
    monkeypatch.setattr(peak._Search, "over_saved_cap", lambda self, *a, **k: called.append("caps") or caps(self, *a, **k))
    plan = solvers.solve(problem, budget, solver="ilp_peak", time_limit=5, prove=False)
    assert searches[0].tied_plan_fits and searches[0].settled
    assert called == ["caps"] and plan.predicted_peak_bytes <= budget  # the first caps only
    tied = min(c.plan.predicted_extra_seconds for c in searches[0].candidates
               if c.plan.solver == "ilp" and c.memory.peak_bytes <= budget)
    assert plan.predicted_extra_seconds <= tied

    searches.clear()
    called.clear()
    solvers.solve(problem, budget, solver="ilp_peak", time_limit=5, prove=True)
    assert not searches[0].settled and called[:3] == ["caps", "untied", "caps"]

    searches.clear()
    called.clear()
    monkeypatch.setattr(peak._Search, "with_mirrored_rows", lambda self, *a: setattr(self, "mirrored_tried", True))
    solvers.solve(problem, budget, solver="ilp_peak", time_limit=5, prove=False)
    assert not searches[0].settled and called[:3] == ["caps", "untied", "caps"]
