"""Every planner against a table of small hand-made problems with known optima.

Sizes are round numbers so expected bytes are exact integers; costs are whole seconds (or
halves) so expected recompute times are exact. A brute-force oracle over all keep sets checks
the table itself, independently of ``closure_from_keep_set`` and of the ILP.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pulp
import pytest

from remat_pass import solvers
from remat_pass.solvers import (
    SOLVERS,
    BudgetInfeasibleError,
    Plan,
    Problem,
    SolverError,
    SolverUnavailableError,
    Value,
    min_feasible_bytes,
    solve,
)
from remat_pass.solvers.mip import solve as _mip
from remat_pass.solvers.mip import run_keep as _run
from remat_pass.solvers.mip.keep_model import rounding_for
from remat_pass.solvers.baselines import articulation_chain, block_of
from remat_pass.solvers.tags import Tag

# "ilp_peak" bounds the simulated peak, not saved bytes: tests/test_peak.py covers it.
SAVED_SOLVERS = sorted(name for name in SOLVERS if name != "ilp_peak")
HEURISTICS = sorted(name for name in SAVED_SOLVERS if name not in ("ilp", "fast", "ilp_offload"))
BACKENDS = ("highs", "cbc")


# ---------------------------------------------------------------- building problems


def problem_of(specs: list[tuple], storage_bytes: list[int], reads: set[str]) -> Problem:
    """Values from ``(name, input names, storage, seconds, extra fields)``; storage 0 is for available ones."""
    ids: dict[str, int] = {}
    values = []
    for name, inputs, storage, seconds, *extra in specs:
        fields = extra[0] if extra else {}
        ids[name] = len(values)
        values.append(Value(len(values), name, tuple(ids[i] for i in inputs), storage, recompute_seconds=seconds,
                            **fields))
    return Problem(tuple(values), tuple(storage_bytes), frozenset(ids[r] for r in reads))


AVAILABLE = {"available": True}


def chain() -> Problem:
    """x -> a -> b -> c, all read by backward (e.g. relu chains)."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("a", ("x",), 1, 1.0), ("b", ("a",), 2, 2.0), ("c", ("b",), 3, 4.0)],
        [0, 100, 100, 100], {"a", "b", "c"},
    )


def diamond() -> Problem:
    """a feeds b and c, which meet in d."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("a", ("x",), 1, 1.0), ("b", ("a",), 2, 3.0), ("c", ("a",), 3, 2.0),
         ("d", ("b", "c"), 4, 1.0)],
        [0, 100, 100, 100, 100], {"b", "c", "d"},
    )


def skip() -> Problem:
    """a residual: d = c + a skips b and c."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("a", ("x",), 1, 1.0), ("b", ("a",), 2, 2.5), ("c", ("b",), 3, 2.0),
         ("d", ("c", "a"), 4, 0.5)],
        [0, 100, 100, 100, 100], {"a", "b", "c", "d"},
    )


def view() -> Problem:
    """v is a view of m (same storage): keeping both costs the storage once."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("m", ("x",), 1, 10.0), ("v", ("m",), 1, 0.0, {"tags": frozenset({Tag.VIEW})}),
         ("y", ("v",), 2, 1.0)],
        [0, 400, 400], {"m", "v", "y"},
    )


def tuple_node() -> Problem:
    """A multi-output op (layer norm: out, mean, rstd) whose tuple itself cannot be kept."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("t", ("x",), 1, 3.0, {"keepable": False}), ("out", ("t",), 2, 0.0),
         ("mean", ("t",), 3, 0.0), ("rstd", ("t",), 4, 0.0), ("y", ("out",), 5, 2.0)],
        [0, 0, 100, 10, 10, 100], {"out", "mean", "rstd", "y"},
    )


def random_op() -> Problem:
    """native_dropout: a random tuple op; its outputs can be kept, never recomputed."""
    random = {"keepable": False, "recomputable": False, "tags": frozenset({Tag.RANDOM})}
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("a", ("x",), 1, 2.0), ("t", ("a",), 2, 1.0, random),
         ("out", ("t",), 3, 0.0), ("mask", ("t",), 4, 0.0), ("y", ("out",), 5, 2.0)],
        [0, 100, 0, 100, 25, 100], {"out", "mask", "y"},
    )


def random_small_child() -> Problem:
    """Keeping the random op's big output beats keeping its small child plus the next output."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("a", ("x",), 1, 2.0),
         ("r", ("a",), 2, 1.0, {"recomputable": False, "tags": frozenset({Tag.RANDOM})}),
         ("s", ("r",), 3, 1.0), ("y", ("r",), 4, 2.0)],
        [0, 100, 100, 4, 100], {"s", "y"},
    )


def transformer() -> Problem:
    """Embedding, two attention blocks (qkv, scores, softmax, context, proj, residual)."""
    specs: list[tuple] = [("x", (), 0, 0.0, AVAILABLE), ("h0", ("x",), 1, 1.0, {"module": "embed"})]
    sizes = [0, 100]
    core = frozenset({Tag.ATTENTION_CORE})
    h = "h0"
    for layer in range(2):
        m = f"blocks.{layer}"
        q, s, p, o, proj = (f"{n}{layer}" for n in ("q", "s", "p", "o", "proj"))
        out = f"h{layer + 1}"
        specs += [
            (q, (h,), len(sizes), 4.0, {"module": f"{m}.attn.qkv"}),
            (s, (q,), len(sizes) + 1, 2.0, {"module": f"{m}.attn", "tags": core}),
            (p, (s,), len(sizes) + 2, 1.0, {"module": f"{m}.attn", "tags": core}),
            (o, (p, q), len(sizes) + 3, 2.0, {"module": f"{m}.attn", "tags": core}),
            (proj, (o,), len(sizes) + 4, 4.0, {"module": f"{m}.attn.proj"}),
            (out, (h, proj), len(sizes) + 5, 0.5, {"module": m}),
        ]
        sizes += [100, 400, 400, 100, 100, 100]
        h = out
    # what each op's backward reads: qkv its input, scores q, softmax p, context p and q,
    # proj its input o, the head h2
    return problem_of(specs, sizes, {"h0", "q0", "p0", "o0", "h1", "q1", "p1", "o1", "h2"})


@dataclass(frozen=True)
class Case:
    """A problem, its smallest feasible budget, and budget -> (least recompute s, kept bytes)."""

    name: str
    build: Callable[[], Problem]
    min_bytes: int
    optima: dict[int, tuple[float, int]]

    @functools.cached_property
    def problem(self) -> Problem:
        return self.build()


CASES = [
    Case("chain", chain, 0, {250: (1.0, 200), 200: (1.0, 200), 199: (3.0, 100), 100: (3.0, 100), 0: (7.0, 0)}),
    Case("diamond", diamond, 0, {200: (1.0, 200), 100: (4.0, 100), 50: (7.0, 0), 0: (7.0, 0)}),
    Case("skip", skip, 0, {300: (0.5, 300), 200: (1.5, 200), 100: (3.5, 100), 0: (6.0, 0)}),
    Case("view", view, 0, {400: (1.0, 400), 399: (11.0, 0)}),
    Case("tuple_node", tuple_node, 0, {120: (2.0, 120), 119: (3.0, 100), 99: (5.0, 0), 0: (5.0, 0)}),
    Case("random_op", random_op, 125, {200: (2.0, 125), 125: (2.0, 125)}),
    Case("random_small_child", random_small_child, 100, {103: (3.0, 100), 100: (3.0, 100)}),
    Case("transformer", transformer, 0, {1400: (1.0, 1400), 1100: (3.0, 1100), 1000: (4.0, 1000), 900: (6.0, 700),
                                         500: (9.0, 500), 200: (19.0, 200), 100: (23.5, 100), 0: (28.0, 0)}),
]
CASE_IDS = [case.name for case in CASES]


# ---------------------------------------------------------------- the oracle


def _walk(problem: Problem, keep: set[int]) -> tuple[set[int], set[int]] | None:
    """Kept and recomputed values if backward keeps exactly ``keep``; None if that cannot work."""
    kept: set[int] = set()
    recomputed: set[int] = set()
    stack = list(problem.backward_reads)
    while stack:
        value = problem.values[stack.pop()]
        if value.available or value.id in kept or value.id in recomputed:
            continue
        if value.id in keep:
            kept.add(value.id)
        elif value.recomputable:
            recomputed.add(value.id)
            stack.extend(value.inputs)
        else:
            return None
    return kept, recomputed


@functools.lru_cache(maxsize=None)
def pareto(problem: Problem) -> tuple[tuple[int, float], ...]:
    """Every (kept bytes, recompute seconds) some keep set achieves, by enumerating all of them."""
    keepable = [v.id for v in problem.values if v.keepable and not v.available]
    points = set()
    for size in range(len(keepable) + 1):
        for keep in itertools.combinations(keepable, size):
            outcome = _walk(problem, set(keep))
            if outcome is not None:
                kept, recomputed = outcome
                points.add((problem.bytes_of(kept), sum(problem.values[i].recompute_seconds for i in recomputed)))
    return tuple(sorted(points))


def oracle(problem: Problem, budget: int) -> tuple[float, int] | None:
    """Least recompute seconds within ``budget``, and the fewest bytes among such plans."""
    fitting = [(seconds, nbytes) for nbytes, seconds in pareto(problem) if nbytes <= budget]
    if not fitting:
        return None
    best = min(seconds for seconds, _ in fitting)
    return best, min(nbytes for seconds, nbytes in fitting if seconds <= best + 1e-12)


def oracle_min_bytes(problem: Problem) -> int:
    return min(nbytes for nbytes, _ in pareto(problem))


def table() -> list[tuple[Case, int, tuple[float, int]]]:
    return [(case, budget, expected) for case in CASES for budget, expected in sorted(case.optima.items())]


TABLE = table()
TABLE_IDS = [f"{case.name}-{budget}" for case, budget, _ in TABLE]


# ---------------------------------------------------------------- exact solvers hit the known optimum


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_table_agrees_with_brute_force(case: Case) -> None:
    assert oracle_min_bytes(case.problem) == case.min_bytes
    for budget, expected in case.optima.items():
        assert oracle(case.problem, budget) == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "budget", "expected"), TABLE, ids=TABLE_IDS)
def test_ilp_hits_known_optimum(case: Case, budget: int, expected: tuple[float, int], backend: str) -> None:
    plan = solve(case.problem, budget, backend=backend)
    seconds, nbytes = expected
    assert plan.recompute_seconds == pytest.approx(seconds, abs=1e-12)
    assert plan.kept_bytes == nbytes  # the tie-break keeps no byte more than needed
    assert (plan.solver, plan.status, plan.gap, plan.budget_bytes) == ("ilp", "optimal", 0.0, budget)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_min_feasible_bytes_is_exact(case: Case) -> None:
    assert min_feasible_bytes(case.problem) == case.min_bytes
    assert min_feasible_bytes(case.problem, backend="cbc") == case.min_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_feasible_bytes_is_exact_to_the_byte_at_large_sizes(backend: str) -> None:
    """Keeping r (10 GB + 7) beats keeping s and y (10 GB + 8) by one byte in ten billion."""
    big = 10_000_000_000
    problem = dataclasses.replace(random_small_child(), storage_bytes=(0, big, big + 7, 4, big + 4))
    assert min_feasible_bytes(problem, backend=backend) == big + 7
    with pytest.raises(BudgetInfeasibleError):
        solve(problem, big + 6, backend=backend)
    assert solve(problem, big + 7, backend=backend).kept_bytes == big + 7


def test_view_storage_is_paid_once() -> None:
    problem = view()
    plan = solve(problem, 400)
    assert {problem.values[i].name for i in plan.kept} == {"m", "v"}
    assert plan.kept_bytes == 400


def test_random_values_are_kept_not_recomputed() -> None:
    problem = random_op()
    names = {v.id: v.name for v in problem.values}
    for solver in SAVED_SOLVERS:
        plan = solve(problem, 150, solver)
        assert {names[i] for i in plan.kept} >= {"out", "mask"}
        assert not {names[i] for i in plan.recomputed} & {"t", "out", "mask"}


# ---------------------------------------------------------------- every planner


@pytest.mark.parametrize("solver", SAVED_SOLVERS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_planner_returns_a_valid_plan(case: Case, solver: str) -> None:
    budget = case.problem.keep_all_bytes() if solver in ("ilp", "fast", "ilp_offload") else 7
    plan = solve(case.problem, budget, solver)
    plan.check()
    assert isinstance(plan, Plan)
    assert plan.solver == solver
    assert plan.budget_bytes == budget
    assert plan.status in ("optimal", "feasible")
    assert plan.kept <= {v.id for v in case.problem.values if v.keepable and not v.available}


@pytest.mark.parametrize("solver", HEURISTICS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_heuristics_never_beat_the_ilp(case: Case, solver: str) -> None:
    heuristic = solve(case.problem, None, solver)
    exact = solve(case.problem, heuristic.kept_bytes)
    assert exact.kept_bytes <= heuristic.kept_bytes
    assert exact.recompute_seconds <= heuristic.recompute_seconds + 1e-12


def test_baselines_on_the_transformer() -> None:
    problem = transformer()
    names = {v.id: v.name for v in problem.values}

    def named(ids: frozenset[int]) -> set[str]:
        return {names[i] for i in ids}

    assert named(solve(problem, None, "keep_all").recomputed) == set()
    assert named(solve(problem, None, "recompute_all").kept) == set()
    per_block = solve(problem, None, "per_block")
    assert named(per_block.kept) == {"h0", "h1"}
    assert named(per_block.recomputed) == {"q0", "s0", "p0", "o0", "q1", "s1", "p1", "o1", "proj1", "h2"}
    selective = solve(problem, None, "selective")
    assert named(selective.recomputed) == {"s0", "p0", "o0", "s1", "p1", "o1"}
    assert named(selective.kept) == {"h0", "q0", "h1", "q1", "h2"}
    assert [names[i] for i in articulation_chain(problem)] == ["h0", "h1", "h2"]
    # two blocks, ceil(sqrt(2)) = 2 blocks a segment: one segment, checkpointed at its input
    assert named(solve(problem, None, "chen_sqrt").kept) == {"h0"}


def test_block_of() -> None:
    assert block_of("blocks.3.attn.qkv") == "blocks.3"
    assert block_of("model.layers.12.mlp") == "model.layers.12"
    assert block_of("blocks.3") == "blocks.3"
    assert block_of("lm_head") is None
    assert block_of("") is None


# ---------------------------------------------------------------- budgets at the edges


@pytest.mark.parametrize("case", [c for c in CASES if c.min_bytes > 0], ids=lambda c: c.name)
def test_infeasible_budget_says_the_exact_minimum(case: Case) -> None:
    with pytest.raises(BudgetInfeasibleError) as caught:
        solve(case.problem, case.min_bytes - 1)
    error = caught.value
    assert (error.budget_bytes, error.min_bytes) == (case.min_bytes - 1, case.min_bytes)
    assert error.keep_all_bytes == case.problem.keep_all_bytes()
    assert isinstance(error, ValueError) and str(case.min_bytes) in str(error)
    assert solve(case.problem, error.min_bytes).kept_bytes <= error.min_bytes


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_negative_budget_is_infeasible(case: Case) -> None:
    with pytest.raises(BudgetInfeasibleError) as caught:
        solve(case.problem, -1)
    assert caught.value.min_bytes == case.min_bytes


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_enough_budget_recomputes_nothing(case: Case) -> None:
    total = case.problem.keep_all_bytes()
    for budget in (None, total, total + 1):
        plan = solve(case.problem, budget)
        assert plan.recomputed == frozenset()
        assert plan.kept_bytes == total
        assert (plan.solver, plan.status, plan.gap, plan.budget_bytes) == ("ilp", "optimal", 0.0, budget)


def test_float_budget_is_refused() -> None:
    with pytest.raises(TypeError):
        solve(chain(), 150.0)


def test_unknown_solver_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown solver 'magic'") as caught:
        solve(chain(), 100, solver="magic")
    for name in SAVED_SOLVERS:
        assert name in str(caught.value)


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="highs"):
        solve(chain(), 100, backend="gurobi")


def test_missing_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_mip, "_backend_works", lambda name: False)
    with pytest.raises(SolverUnavailableError, match="pip install highspy"):
        solve(chain(), 100, backend="highs")
    with pytest.raises(SolverUnavailableError, match="reinstall"):
        solve(chain(), 100, backend="cbc")
    with pytest.raises(ImportError, match="pip install highspy"):
        solve(chain(), 100)


def test_auto_backend_falls_back_to_cbc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_mip, "_backend_works", lambda name: name == "cbc")
    assert _mip.resolve_backend("auto") == "cbc"
    assert solve(chain(), 100).recompute_seconds == 3.0


# ---------------------------------------------------------------- rounding bytes


def coprime_chain() -> Problem:
    """Sizes with gcd 1 and a keep-all far above 2**20 bytes: rounding to units is lossy."""
    return problem_of(
        [("x", (), 0, 0.0, AVAILABLE), ("a", ("x",), 1, 1.0), ("b", ("a",), 2, 2.0), ("c", ("b",), 3, 4.0)],
        [0, 1_000_003, 2_000_029, 1_500_007], {"a", "b", "c"},
    )


@pytest.mark.parametrize("budget", [1_500_007, 2_000_029, 2_500_010, 3_000_032, 3_500_036, 3_500_035])
def test_lossy_rounding_still_exact(budget: int) -> None:
    problem = coprime_chain()
    assert not rounding_for(problem).exact
    plan = solve(problem, budget)
    seconds, nbytes = oracle(problem, budget)
    assert plan.kept_bytes <= budget
    assert plan.recompute_seconds == pytest.approx(seconds)
    assert plan.status == "optimal" and plan.gap == 0.0


# ---------------------------------------------------------------- honest status under a time limit


def _patched_run_mip(monkeypatch: pytest.MonkeyPatch, **changes: object) -> None:
    """Let the real backend solve, then report what a time-limit stop would have reported."""
    real = _run.run_mip

    def run(model: pulp.LpProblem, **options: object) -> _mip.MipResult:
        result = real(model, **options)
        if options.get("mip", True) is False:
            return result
        return dataclasses.replace(result, **{k: (v(result) if callable(v) else v) for k, v in changes.items()})

    monkeypatch.setattr(_run, "run_mip", run)


def test_stop_with_incumbent_reports_feasible_and_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    _patched_run_mip(monkeypatch, status="feasible", bound=lambda r: r.objective / 2)
    plan = solve(chain(), 100)
    assert plan.recompute_seconds == 3.0
    assert plan.status == "feasible"
    assert plan.gap == pytest.approx(0.5)


def test_stop_without_reported_bound_uses_lp_relaxation(monkeypatch: pytest.MonkeyPatch) -> None:
    _patched_run_mip(monkeypatch, status="feasible", bound=None)
    plan = solve(diamond(), 100)
    assert plan.gap is not None and 0.0 <= plan.gap < 1.0
    # The LP relaxation's optimum may itself prove the plan optimal; then, and only then, it says so.
    assert (plan.status == "optimal") == (plan.gap == 0.0)
    assert plan.status in ("optimal", "feasible")


def test_runs_that_find_nothing_leave_the_heuristic_plan_unproven(monkeypatch: pytest.MonkeyPatch) -> None:
    _patched_run_mip(monkeypatch, status="no_solution", values={}, objective=None, bound=None, stopped=True)
    plan = solve(chain(), 100, time_limit=5)
    assert plan.kept_bytes <= 100
    assert plan.status == "time_limit"
    assert plan.gap is not None and plan.gap > 0


def test_run_mip_reads_sol_status_not_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """PuLP says status "Optimal" after a time-limit stop; only sol_status tells the truth."""
    model = pulp.LpProblem("m", pulp.LpMinimize)
    x = _mip.binary(model, "x")
    model += x
    model += x >= 0

    def stopped(self: pulp.LpProblem, solver: object = None, **kwargs: object) -> int:
        x.varValue = 1.0
        self.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)
        return self.status

    monkeypatch.setattr(pulp.LpProblem, "solve", stopped)
    result = _mip.run_mip(model, backend="cbc", time_limit=1)
    assert result.status == "feasible"
    assert result.objective == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_time_limit_on_a_bigger_problem_stays_honest(backend: str) -> None:
    """A real stop (usually: this takes ~0.1 s to prove): whatever comes back must be honest."""
    problem = layered(layers=60, width=10)
    budget = problem.keep_all_bytes() // 3
    try:
        plan = solve(problem, budget, backend=backend, time_limit=0.01)
    except SolverError as error:
        assert "time_limit" in str(error)
        return
    assert plan.kept_bytes <= budget
    if plan.status == "optimal":
        assert plan.gap == 0.0
    else:
        assert plan.status in ("feasible", "time_limit")
        assert plan.gap is not None and 0.0 <= plan.gap <= 1.0
        assert plan.recompute_seconds >= solve(problem, budget, backend=backend).recompute_seconds


def layered(layers: int, width: int) -> Problem:
    """A deterministic layered DAG with shared storages: big enough that solving takes a while."""
    specs: list[tuple] = [("x", (), 0, 0.0, AVAILABLE)]
    sizes = [0]
    previous = ["x"]
    for layer in range(layers):
        current = []
        for j in range(width):
            name = f"v{layer}_{j}"
            inputs = tuple(previous[(j + k) % len(previous)] for k in range(1 + (layer + j) % 3))
            storage = len(sizes) - 1 if j % 4 == 3 else len(sizes)
            if storage == len(sizes):
                sizes.append(64 * (1 + (layer * 7 + j * 13) % 17))
            specs.append((name, tuple(dict.fromkeys(inputs)), storage, 1.0 + (layer * 5 + j * 3) % 11,
                          {"recomputable": (layer * width + j) % 23 != 5}))
            current.append(name)
        previous = current
    reads = {name for index, (name, *_) in enumerate(specs[1:]) if index % 3 != 1}
    return problem_of(specs, sizes, reads)


# ---------------------------------------------------------------- packaging


def test_solvers_package_does_not_import_torch() -> None:
    code = "import sys, solvers; bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api() -> None:
    for name in ("Problem", "Value", "Plan", "closure_from_keep_set", "format_bytes", "solve", "SOLVERS",
                 "min_feasible_bytes", "BudgetInfeasibleError", "SolverError", "SolverUnavailableError", "RematError"):
        assert hasattr(solvers, name), name
    assert set(SOLVERS) == {"ilp", "ilp_peak", "fast", "ilp_offload", "keep_all", "recompute_all",
                            "chen_sqrt", "per_block", "selective"}
