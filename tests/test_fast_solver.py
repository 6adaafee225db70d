"""The fast planner ("fast", ``solvers.fast``) against the exact ILP, and block detection (``solvers.fast.blocks``).

The reference is the ILP on PuLP's CBC: on these tiny problems it is instant, and it does not
share the HiGHS MIP-start quirk (see ``mip.solve._stale_highs_solution``).
Random problems come from a fixed-seed table: chains of identical blocks (with and without values
that couple neighbouring blocks) and unstructured bodies, with views sharing storages, tuple
values, random (never recomputed) ops and available inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from remat_pass import solvers
from remat_pass.solvers import SOLVERS, BudgetInfeasibleError, Problem, Value, min_feasible_bytes, solve
from remat_pass.solvers.fast import solve_fast, tradeoff_hull
from remat_pass.solvers.fast.blocks import decompose
from remat_pass.solvers.fast.oracle import Oracle
from remat_pass.solvers.fast.refine import group_problem
from remat_pass.solvers.ilp import solve_ilp
from remat_pass.solvers.tags import Tag

TOLERANCE = 1e-9


def random_problem(seed: int, blocks: int = 0, size: int = 10) -> Problem:
    """``blocks`` identical random blocks in a chain (one unstructured body when 0)."""
    rng = random.Random(seed)
    spec = []
    made = 0  # tensors a block has made so far; position 0 is its input
    for _ in range(size):
        kind = rng.choices(["op", "view", "tuple", "random"], [6, 2, 1, 1])[0]
        if kind == "view" and made == 0:
            kind = "op"
        source = rng.randint(1, made) if kind == "view" else (made if rng.random() < 0.6 else rng.randint(0, made))
        extra = rng.randint(0, made) if rng.random() < 0.3 else None
        spec.append((kind, source, extra, 8 * rng.randint(1, 32), rng.choice([0.5, 1.0, 2.0, 4.0, 8.0]),
                     rng.random() < 0.7, [rng.random() < 0.4 for _ in range(2)]))
        made += 2 if kind == "tuple" else 1
    output_read = rng.random() < 0.5  # if not, the block output couples the blocks
    values = [Value(0, "x", (), storage=0, available=True)]
    sizes = [0]
    reads: set[int] = set()

    def add(**fields) -> int:
        values.append(Value(len(values), f"v{len(values)}", **fields))
        return len(values) - 1

    entry = 0
    for block in range(max(blocks, 1)):
        module = f"layers.{block}" if blocks else "body"
        local = [entry]
        for kind, source, extra, nbytes, seconds, recomputable, read in spec:
            src = local[source]
            if kind == "view":
                local.append(add(inputs=(src,), storage=values[src].storage, module=module, tags=frozenset({Tag.VIEW})))
                reads.update(local[-1:] if read[0] else ())
            elif kind == "tuple":
                op = add(inputs=(src,), storage=0, recompute_seconds=seconds, keepable=False, module=module,
                         recomputable=recomputable)
                for j in range(2):
                    sizes.append(nbytes // (j + 1))
                    local.append(add(inputs=(op,), storage=len(sizes) - 1, module=module))
                    reads.update(local[-1:] if read[j] else ())
            else:
                inputs = tuple(sorted({src} | ({local[extra]} if extra is not None else set())))
                sizes.append(nbytes)
                local.append(add(inputs=inputs, storage=len(sizes) - 1, recompute_seconds=seconds, module=module,
                                 recomputable=kind != "random",
                                 tags=frozenset({Tag.RANDOM}) if kind == "random" else frozenset()))
                reads.update(local[-1:] if read[0] else ())
        entry = local[-1]
        if output_read or block == max(blocks, 1) - 1:
            reads.add(entry)
    return Problem(tuple(values), tuple(sizes), frozenset(r for r in reads if values[r].keepable))


CASES = [(seed, blocks) for seed in range(14) for blocks in (0, 3)]


def budgets(problem: Problem) -> list[int]:
    low, high = min_feasible_bytes(problem, backend="cbc"), problem.keep_all_bytes()
    return sorted({low, low + (high - low) // 3, low + 2 * (high - low) // 3, max(high - 1, low)})


@pytest.mark.parametrize("seed,blocks", CASES)
def test_fast_matches_the_ilp_within_its_stated_gap(seed: int, blocks: int) -> None:
    problem = random_problem(seed, blocks)
    for budget in budgets(problem):
        optimum = solve_ilp(problem, budget, backend="cbc").recompute_seconds
        for options in ({"polish": False, "refine": False}, {}):
            plan = solve_fast(problem, budget, **options)
            plan.check()
            assert plan.kept_bytes <= budget and plan.budget_bytes == budget and plan.solver == "fast"
            assert plan.recompute_seconds >= optimum - TOLERANCE, "better than the proven optimum"
            # The gap is measured from a lower bound: it must not exceed the optimum.
            assert plan.recompute_seconds * (1 - plan.gap) <= optimum + TOLERANCE * max(optimum, 1)
            if plan.status == "optimal":
                assert plan.recompute_seconds == pytest.approx(optimum, abs=TOLERANCE)
        # With the default polish these small problems are always proven.
        assert plan.status == "optimal"


@pytest.mark.parametrize("seed,blocks", [(s, b) for s in range(8) for b in (0, 3)])
def test_infeasible_budgets_raise_with_the_exact_minimum(seed: int, blocks: int) -> None:
    problem = random_problem(seed, blocks)
    smallest = min_feasible_bytes(problem, backend="cbc")
    if smallest == 0:
        assert solve_fast(problem, 0).kept_bytes == 0
        return
    with pytest.raises(BudgetInfeasibleError) as error:
        solve_fast(problem, smallest - 1)
    assert error.value.min_bytes == smallest and error.value.budget_bytes == smallest - 1
    assert solve_fast(problem, smallest).kept_bytes == smallest


@pytest.mark.parametrize("seed,blocks", [(s, b) for s in range(8) for b in (0, 3, 4)])
def test_hull_vertices_are_optimal(seed: int, blocks: int) -> None:
    """Each vertex of the Lagrangian hull is the exact optimum at its own byte count (couplings included)."""
    problem = random_problem(seed, blocks)
    hull = tradeoff_hull(problem)
    assert [p.kept_bytes for p in hull] == sorted((p.kept_bytes for p in hull), reverse=True)
    assert [p.recompute_seconds for p in hull] == sorted(p.recompute_seconds for p in hull)
    assert hull[0].recompute_seconds == 0.0
    for point in hull:
        exact = solve_ilp(problem, point.kept_bytes, backend="cbc")
        assert exact.recompute_seconds == pytest.approx(point.recompute_seconds, abs=TOLERANCE)


def test_identical_blocks_are_cut_once() -> None:
    separable = random_problem(1, blocks=6)  # block outputs read by backward: no couplings
    split = decompose(separable)
    assert split.block_classes() == [[f"layers.{i}" for i in range(6)]] and not split.couplings
    oracle = Oracle(separable, split)
    oracle.evaluate(1e-3)
    assert oracle.cuts == len(split.classes)  # one cut per class, whatever the depth
    coupled = random_problem(0, blocks=6)  # block outputs not read: each couples two blocks
    split = decompose(coupled)
    assert split.couplings and ["layers.1", "layers.2", "layers.3", "layers.4"] in split.block_classes()
    oracle = Oracle(coupled, split)
    oracle.evaluate(1e-3)
    # One cut per (class, coupling states) pair: the middle blocks share theirs.
    assert oracle.cuts <= sum(2 ** len(split.groups[c[0]].touched) for c in split.classes)


def test_registered_and_keep_all_budget() -> None:
    assert SOLVERS["fast"] is solve_fast
    problem = random_problem(1, blocks=3)
    plan = solve(problem, problem.keep_all_bytes(), solver="fast")
    assert (plan.solver, plan.status, plan.gap, plan.recomputed) == ("fast", "optimal", 0.0, frozenset())
    assert solve(problem, None, solver="fast").kept_bytes == problem.keep_all_bytes()


def test_tiny_time_limit_still_gives_a_valid_plan() -> None:
    problem = random_problem(5, blocks=3)
    budget = min_feasible_bytes(problem, backend="cbc") + 8
    plan = solve_fast(problem, budget, time_limit=1e-4)
    plan.check()
    assert plan.kept_bytes <= budget and plan.status in ("optimal", "feasible", "time_limit")


def test_views_are_paid_once() -> None:
    """Keeping a view costs its base's storage; the model keeps the base and rebuilds the view for free."""
    x = Value(0, "x", (), storage=0, available=True)
    a = Value(1, "a", (0,), storage=1, recompute_seconds=5.0)
    view = Value(2, "a_t", (1,), storage=1, tags=frozenset({Tag.VIEW}))
    b = Value(3, "b", (2,), storage=2, recompute_seconds=1.0)
    problem = Problem((x, a, view, b), (0, 64, 64), frozenset({2, 3}))
    plan = solve_fast(problem, 64, polish=False, refine=False)
    assert plan.kept_bytes == 64 and plan.recompute_seconds == 1.0 and plan.status == "optimal"


def test_group_problem_mirrors_the_group() -> None:
    problem = random_problem(2, blocks=3)
    split = decompose(problem)
    group = split.groups[-1]
    sub, order = group_problem(problem, group.members, frozenset(), frozenset())
    assert order[-len(group.members):] == group.members
    assert sub.keep_all_bytes() == problem.bytes_of(problem.backward_reads & set(group.members))


# --- a real graph ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_problem() -> Problem:
    from remat_pass.examples import GPT, GPTConfig
    from remat_pass.planning.pipeline import trace_step

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, layers=4, hidden=32, heads=2))
    traced = trace_step(model, (torch.randint(0, 64, (2, 16)),), device="cpu")
    torch._dynamo.reset()
    return traced.problem


def test_blocks_found_on_a_small_gpt(gpt_problem: Problem) -> None:
    split = decompose(gpt_problem)
    assert split.block_classes() == [["blocks.0", "blocks.1", "blocks.2", "blocks.3"]]
    sizes = {len(g.members) for g in split.groups if g.is_block}
    assert len(sizes) == 1
    # The views AOTAutograd placed outside every module joined their blocks.
    assert all(g.name.startswith("(rest)") or g.is_block for g in split.groups)
    outside = [v for g in split.groups if not g.is_block for v in g.members]
    assert all(gpt_problem.values[v].module == "" or not gpt_problem.values[v].module.startswith("blocks")
               for v in outside)


@pytest.mark.parametrize("fraction", [0.2, 0.45, 0.7])
def test_fast_on_a_real_graph(gpt_problem: Problem, fraction: float) -> None:
    budget = int(fraction * gpt_problem.keep_all_bytes())
    try:
        optimum = solve_ilp(gpt_problem, budget, backend="cbc").recompute_seconds
    except BudgetInfeasibleError as error:
        with pytest.raises(BudgetInfeasibleError) as ours:
            solve_fast(gpt_problem, budget)
        assert ours.value.min_bytes == error.min_bytes
        return
    unpolished = solve_fast(gpt_problem, budget, polish=False)
    assert unpolished.kept_bytes <= budget
    assert unpolished.recompute_seconds * (1 - unpolished.gap) <= optimum * (1 + 1e-9)
    assert unpolished.recompute_seconds <= optimum * 1.01 + TOLERANCE  # the quality target
    plan = solvers.solve(gpt_problem, budget, solver="fast")
    assert plan.status == "optimal" and plan.recompute_seconds == pytest.approx(optimum, rel=1e-9)
