"""Fitting a peak budget to the compiled program (``remat_pass.runtime.inductor_fit``).

The search is tested against models of a compiler (a measured peak that is a known function of
the budget the planner was asked for), with exact numbers; the measurement on a real step, with
exact allocator bytes; and one step compiled by Inductor end to end (marked ``backend_default``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import pytest
import torch

import remat_pass
from remat_pass import BudgetInfeasibleError
from remat_pass.runtime.inductor_fit import SamePlan, fit_peak, measure_step_peak, plan_identity
from remat_pass.runtime.measure import allocator_peak

from .helpers import run_step
from .models import make_case

B = 1_000_000  # the user's peak budget in the models below


@dataclass(frozen=True)
class FakeProblem:
    """What the fitting reads of a plan's problem: the cost model's forward time (0: no prices, so
    the fit never stops for want of gain)."""

    forward: float = 0.0

    def forward_seconds(self) -> float:
        return self.forward


@dataclass(frozen=True)
class FakePlan:
    """What the fitting reads of a plan; one plan per budget asked (``asked`` makes it distinct)."""

    asked: int
    budget_bytes: int
    predicted_extra_seconds: float
    problem: FakeProblem = FakeProblem()
    recomputed: frozenset[int] = frozenset({1})
    kept: frozenset[int] = frozenset()
    offloaded: frozenset[int] = frozenset()
    refreshed: frozenset[int] = field(default_factory=frozenset)
    fused: frozenset[int] = field(default_factory=frozenset)
    predicted_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kept", frozenset({self.asked}))

    @property
    def kept_bytes(self) -> int:
        return self.asked // 2  # a refusal says what its lowest-peaked plan keeps


class Compiler:
    """A model of planning then compiling: ``measured(asked)`` is the compiled step's peak of the
    plan made at a peak budget of ``asked`` bytes (None: the user's ``B``). Plans asked below
    ``floor`` are refused, as the unfused model refuses them; less budget costs more recompute."""

    def __init__(self, measured, floor: int = 0, same_below: int | None = None, same_above: int | None = None,
                 forward_seconds: float = 0.0) -> None:
        self.measured, self.floor, self.same_below, self.same_above = measured, floor, same_below, same_above
        self.problem = FakeProblem(forward_seconds)
        self.asked: list[int | None] = []

    def __call__(self, asked, seen):
        self.asked.append(asked)
        budget = B if asked is None else asked
        if budget < self.floor:
            raise BudgetInfeasibleError(budget, self.floor, 2 * B, kind="peak")
        if self.same_below is not None:
            budget = max(budget, self.same_below)  # the model has no cheaper plan below this
        if self.same_above is not None and budget >= self.same_above:
            budget = B  # the model's plan at the user's budget fits this one too
        plan = FakePlan(budget, budget, predicted_extra_seconds=(2 * B - budget) / B, problem=self.problem)
        if plan_identity(plan) in seen:
            raise SamePlan(plan_identity(plan))
        return budget, plan  # the "compiled step" is the budget it was planned at

    def measure(self, compiled, inputs):
        return self.measured(compiled)


def test_a_compiled_program_over_its_model_is_planned_lower_until_it_fits():
    """Inductor's program peaks 20% over the model: 1.2 B, then 0.942 B (too far under), then
    0.9936 B (within 3% under): three compiles, and the one that runs is within the budget."""
    compiler = Compiler(lambda asked: int(asked * 1.2))
    chosen = fit_peak(compiler, (), measure=compiler.measure)
    assert compiler.asked == [None, 785_000, 828_000]
    assert chosen.measured_bytes == 993_600
    assert chosen.plan.budget_bytes == B  # the record says the user's budget, not the asked one


def test_no_further_candidate_is_compiled_for_a_gain_below_the_prices_error():
    """As above, but the step is priced at 3 x 20 s: after 1.2 B (over; 1.0 s of recompute) and
    0.942 B (within the budget; 1.215 s), a further candidate lies between and could save at most
    0.215 s, 0.36% of the step, under ``MIN_GAIN`` (0.5%): two compiles, and the second runs. With a
    step priced at 3 x 10 s (0.72%) the search goes on to the third."""
    from remat_pass.runtime.inductor_fit import MIN_GAIN

    assert MIN_GAIN == 0.005
    compiler = Compiler(lambda asked: int(asked * 1.2), forward_seconds=20.0)
    chosen = fit_peak(compiler, (), measure=compiler.measure)
    assert compiler.asked == [None, 785_000] and chosen.measured_bytes == 942_000
    compiler = Compiler(lambda asked: int(asked * 1.2), forward_seconds=10.0)
    assert fit_peak(compiler, (), measure=compiler.measure).measured_bytes == 993_600
    assert compiler.asked == [None, 785_000, 828_000]


def test_the_gain_left_is_measured_from_the_plan_at_the_brackets_ceiling():
    """Two plans measured over (asked at 1.0 and 0.9 MB: 0.5 and 0.6 s of recompute), one within
    (0.8 MB: 0.7 s), a step of 3 x 10 s: a further budget is asked below 0.9 MB, where no plan
    recomputes less than 0.6 s, so at most 0.1 s is left to gain (not 0.2 s)."""
    from remat_pass.runtime.inductor_fit import Candidate, _gain_left

    problem = FakeProblem(10.0)
    made = [Candidate(asked, FakePlan(asked, asked, seconds, problem=problem), measured, None)
            for asked, seconds, measured in ((B, 0.5, 1_100_000), (900_000, 0.6, 1_050_000), (800_000, 0.7, 960_000))]
    assert _gain_left(made, B) == pytest.approx(0.1 / 30)
    assert _gain_left(made[:2], B) == float("inf")  # none within the budget yet
    assert _gain_left(made[2:], B) == pytest.approx(0.7 / 30)  # none over: against recomputing nothing


def test_a_compiled_program_under_its_model_is_given_more_and_recomputes_less():
    compiler = Compiler(lambda asked: int(asked * 0.8))
    chosen = fit_peak(compiler, (), measure=compiler.measure)
    assert compiler.asked[:2] == [None, 1_185_000]
    assert B * 0.97 <= chosen.measured_bytes <= B
    assert chosen.plan.predicted_extra_seconds < (2 * B - B) / B  # cheaper than the first plan


def test_a_budget_the_unfused_model_refuses_is_kept_when_the_fused_program_fits(caplog):
    """The refusal path (HF BERT under per-block checkpointing's peak, benchmarks/VS_INDUCTOR.md):
    the model's lowest plan is compiled and measured instead of refused; the refusal is logged."""
    compiler = Compiler(lambda asked: int(asked * 0.7), floor=1_200_000)
    with caplog.at_level(logging.INFO, logger="remat_pass.runtime.inductor_fit"):
        chosen = fit_peak(compiler, (), measure=compiler.measure)
    assert compiler.asked[:2] == [None, 1_200_000]
    assert chosen.measured_bytes <= B
    assert "the planner refused 1000000 bytes (its lowest simulated peak: 1200000)" in caplog.text


def test_the_last_tries_refusal_of_the_users_budget_ends_it():
    """The backend's last try before a refusal plans the user's budget searching at length; refused
    there, it compiles nothing more (each further candidate was compiled by the fits before it)."""
    compiler = Compiler(lambda asked: int(asked * 0.7), floor=1_200_000)
    with pytest.raises(BudgetInfeasibleError):
        fit_peak(compiler, (), measure=compiler.measure, first_refusal_ends=True)
    assert compiler.asked == [None]


def test_no_candidate_within_the_budget_is_a_refusal_with_the_lowest_measured_peak(caplog):
    """Every plan measures twice its budget and none can be made below 900 kB: the search brackets
    (1 MB over; 500, 750, 875 kB refused; 937.5 and 906.25 kB over) and refuses with the lowest
    peak it measured, or with ``clamp`` runs that plan."""
    compiler = Compiler(lambda asked: 2 * asked, floor=900_000)
    with pytest.raises(BudgetInfeasibleError) as refused:
        fit_peak(compiler, (), measure=compiler.measure)
    assert compiler.asked == [None, 500_000, 750_000, 875_000, 937_500, 906_250]
    assert refused.value.budget_bytes == B and refused.value.min_bytes == 1_812_500
    assert refused.value.lowest_kept_bytes == 906_250 // 2  # what the lowest-peaked plan keeps
    assert refused.value.kind == "peak"
    with caplog.at_level(logging.WARNING, logger="remat_pass.runtime.inductor_fit"):
        clamped = fit_peak(Compiler(lambda asked: 2 * asked, floor=900_000), (), measure=compiler.measure, clamp=True)
    assert clamped.measured_bytes == 1_812_500
    assert any("on_infeasible='clamp'" in record.getMessage() for record in caplog.records)


def test_a_replan_that_gives_a_plan_measured_over_asks_lower_until_a_new_plan_fits():
    """HF GPT-2 at torch's 0.1 point (benchmarks/VS_INDUCTOR.md): the plan made at the user's
    budget measured over it, and the unfused model gave the same plan at the lower budget the fit
    asked next. Before, that ended the search with a refusal; now the fit asks lower (the
    bracket's middle), where new plans fit."""
    compiler = Compiler(lambda asked: int(asked * 1.2), same_above=700_000)
    chosen = fit_peak(compiler, (), measure=compiler.measure)
    assert compiler.asked[:3] == [None, 785_000, 392_500]  # 785 kB: the 1 MB plan again
    assert chosen.measured_bytes <= B and chosen.asked < 700_000


def test_a_model_with_no_other_plan_refuses_after_a_bounded_number_of_answers():
    compiler = Compiler(lambda asked: 2 * asked, same_below=B)
    with pytest.raises(BudgetInfeasibleError):
        fit_peak(compiler, (), measure=compiler.measure)
    assert len(compiler.asked) == 2 * 6  # one compile, then plans measured before: no compile each


def test_a_plan_that_recomputes_nothing_is_not_given_more():
    compiler = Compiler(lambda asked: asked // 2)
    chosen = fit_peak(lambda asked, seen: (B // 2, FakePlan(B, B, 0.0, recomputed=frozenset())), (),
                      measure=compiler.measure)
    assert chosen.measured_bytes == B // 4


def test_the_measured_step_peak_is_the_allocators_and_leaves_no_trace():
    """A step of 1000 floats: ``x * w`` (4000 B) and its sum (4 B) live together; the gradient of
    ``w`` is returned (left out). The in-place update of a buffer input and the random draw are
    undone."""
    x = torch.randn(1000)
    w = torch.randn(1000, requires_grad=True)
    buffer = torch.zeros(3)

    def step(x, w, buffer):
        buffer.add_(1)
        return (x * w).sum() + torch.rand(()) * 0

    state = torch.get_rng_state()
    peak = measure_step_peak(step, (x, w, buffer))
    assert peak == 4000 + 4  # the product and its sum; the scalar temporaries come after the product is freed
    assert torch.equal(buffer, torch.zeros(3)) and torch.equal(torch.get_rng_state(), state)
    assert w.grad is None
    assert measure_step_peak(lambda x: x * 2, (x,)) is None  # no gradient wanted: nothing to fit


@pytest.mark.backend_default
def test_inductor_under_a_peak_budget_measures_within_it_with_inductors_gradients():
    """The promise end to end: the GPT step (dropout on) compiled by Inductor at a peak budget of
    0.8 of what torch.compile's own step measures; the fitted step measures within it, and its
    loss and gradients equal Inductor's without remat bit for bit, dropout masks included (Inductor's
    own RNG draws the same masks; no random op runs twice)."""
    model, inputs, loss_fn = make_case("gpt")
    reference = copy.deepcopy(model)

    def step_of(module, compiled):
        def step():
            torch.manual_seed(7)
            loss = loss_fn(compiled(*inputs), *inputs)
            loss.backward()
            return loss
        return step

    plain = torch.compile(reference)
    step_of(reference, plain)()  # compiled, and warm
    reference.zero_grad(set_to_none=True)
    incumbent = allocator_peak(step_of(reference, plain), "cpu", lambda: [p.grad for p in reference.parameters()])
    budget = int(0.8 * incumbent.peak_excluding)
    backend = remat_pass.backend(budget=budget, budget_kind="peak", inner="inductor")
    assert backend.fits_compiled_peak
    compiled = torch.compile(model, backend=backend)
    step_of(model, compiled)()
    model.zero_grad(set_to_none=True)
    measured = allocator_peak(step_of(model, compiled), "cpu", lambda: [p.grad for p in model.parameters()])
    assert measured.peak_excluding <= budget
    assert len(backend.plans) == 1 and backend.plans[0].budget_bytes == budget and backend.plans[0].recomputed
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    assert torch.equal(step_of(model, compiled)(), step_of(reference, plain)())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.backend_default
def test_a_budget_inductor_cannot_be_fitted_to_runs_eager_when_inductor_was_only_the_default(monkeypatch, caplog):
    """The fitting fails (made to, here: no Inductor compile runs); the default backend then plans
    and runs the graph eager, the step equal to eager's bit for bit; asked for by name, it refuses."""
    from remat_pass.runtime import peak_fitting

    def refuse(compile_at, inputs, **options):
        raise BudgetInfeasibleError(10**6, 2 * 10**6, 3 * 10**6, kind="peak")

    monkeypatch.setattr(peak_fitting, "fit_peak", refuse)
    model, inputs, loss_fn = make_case("mlp")
    expected = run_step(copy.deepcopy(model), copy.deepcopy(model), inputs, loss_fn)
    backend = remat_pass.backend(budget="10MB")
    assert backend.inner == "inductor" and backend.fits_compiled_peak
    with caplog.at_level(logging.WARNING, logger="remat_pass.runtime.peak_fitting"):
        actual = run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    assert torch.equal(actual.loss, expected.loss)
    assert all(torch.equal(actual.grads[name], grad) for name, grad in expected.grads.items())
    assert len(backend.plans) == 1 and backend.plans[0].budget_bytes == 10**7
    assert any("running this graph with inner='eager'" in record.getMessage() for record in caplog.records)
    torch._dynamo.reset()
    asked = remat_pass.backend(budget="10MB", inner="inductor")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="BudgetInfeasibleError"):
        run_step(model, torch.compile(model, backend=asked), inputs, loss_fn)


def test_where_no_plan_priced_for_the_fused_program_fits_plans_priced_unfused_are_fitted(monkeypatch):
    """The first fit plans with the fused model (recomputes priced fused into their readers, the
    backward tensors Inductor never allocates left out); where it refuses, a second fit keeps the
    prices and counts every backward tensor, a third prices every recompute as a kernel of its own; a
    refusal of all names the lowest of their lowest measured peaks."""
    from remat_pass.runtime import peak_fitting

    models: list[tuple[bool, bool]] = []

    def refuse(compile_at, inputs, **options):
        now = backend._options_now()
        models.append((now.fused_prices, now.fused_memory))
        lowest = 2 * 10**6 if len(models) == 1 else 15 * 10**5
        raise BudgetInfeasibleError(10**6, lowest, 3 * 10**6, kind="peak")

    monkeypatch.setattr(peak_fitting, "fit_peak", refuse)
    model, inputs, loss_fn = make_case("mlp")
    backend = remat_pass.backend(budget="1MB", inner="inductor", chunk_loss=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="1500000 bytes"):
        run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    # The last: the fused fit again, searching longer.
    assert models == [(True, True), (True, False), (False, False), (True, True)]
    assert backend._options_now().fused_memory  # the next graph starts with the fused model again
    assert backend._options_now().fused_prices  # the next graph starts priced fused again


def test_the_fits_candidates_are_refused_without_the_longer_search(monkeypatch):
    """A planner's refusal inside the fit moves the fit to another budget, so the fit's candidates
    are planned without the search that runs on before a refusal (``effort.REFUSAL_TIME_LIMIT``),
    until the last fit before the budget is refused; a plan outside a fit keeps it."""
    from remat_pass.runtime import peak_fitting

    seen: list[bool] = []

    def record(compile_at, inputs, **options):
        backend._fitting.seen = set()  # as fit_peak's compile_at sets it while a candidate compiles
        seen.append(backend._options_now().search_before_refusing)
        backend._fitting.seen = None
        raise BudgetInfeasibleError(10**6, 2 * 10**6, 3 * 10**6, kind="peak")

    monkeypatch.setattr(peak_fitting, "fit_peak", record)
    model, inputs, loss_fn = make_case("mlp")
    backend = remat_pass.backend(budget="1MB", inner="inductor", chunk_loss=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    # The fused model, its prices with every backward tensor, priced unfused, then fused searching longer.
    assert seen == [False, False, False, True]
    assert backend._options_now().search_before_refusing


def test_a_budget_the_fits_short_searches_refuse_is_fitted_searching_longer(monkeypatch):
    """The fit plans each candidate with the short search alone, and which budgets that search
    answers depends on the machine's load (a refusal where torch fits, beside a CI run). Made to
    refuse every such budget here, the backend fits once more, its first plan searched at length,
    and that fit's plan runs, measured within the budget, instead of a refusal."""
    from remat_pass.runtime import dynamo_backend

    plan = dynamo_backend.plan_joint_graph

    def loaded(joint, options):
        if not options.search_before_refusing:
            raise BudgetInfeasibleError(options.budget.nbytes or 10**7, 10**7, 2 * 10**7, kind="peak")
        return plan(joint, options)

    monkeypatch.setattr(dynamo_backend, "plan_joint_graph", loaded)
    model, inputs, loss_fn = make_case("mlp")
    expected = run_step(copy.deepcopy(model), copy.deepcopy(model), inputs, loss_fn)
    backend = remat_pass.backend(budget="10MB", budget_kind="peak", inner="inductor", chunk_loss=False)
    actual = run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    assert len(backend.plans) == 1 and backend.plans[0].budget_bytes == 10**7
    assert torch.allclose(actual.loss, expected.loss)


def test_a_compile_that_fails_inside_inductor_is_named_as_inductors_not_as_a_remat_pass_bug():
    """Two processes writing one Inductor cache gave ``ImportError: ...so: file too short``, which
    was reported as "a remat_pass bug". A failure raised inside torch._inductor names Inductor, its
    cache directory and the way around it; anything else is still ours to fix."""
    import os

    from remat_pass.runtime.api import backend_failure

    def defined_in(path: str, source: str) -> dict:
        namespace: dict = {}
        exec(compile(source, path, "exec"), namespace)
        return namespace

    inductor = defined_in(os.path.join(os.path.dirname(torch.__file__), "_inductor", "codecache.py"),
                          "def load():\n    raise ImportError('main.so: file too short')\n"
                          "def partition(ours):\n    return ours()\n")
    ours = defined_in(os.path.join(os.path.dirname(remat_pass.__file__), "capture", "capture.py"),
                      "def partition():\n    raise ValueError(\"a planner's own bug\")\n")
    blamed = {}
    for name, call in (("inductor", inductor["load"]), ("ours", lambda: inductor["partition"](ours["partition"])),
                       ("elsewhere", lambda: ours["partition"]())):
        try:
            call()
        except (ImportError, ValueError) as error:
            blamed[name] = str(backend_failure(error))
    assert "Inductor failed" in blamed["inductor"] and "TORCHINDUCTOR_CACHE_DIR" in blamed["inductor"]
    assert "remat_pass bug" not in blamed["inductor"]
    # Inductor calls our partitioner: an error raised in it is ours, Inductor's frames above it.
    assert "remat_pass bug" in blamed["ours"] and "remat_pass bug" in blamed["elsewhere"]


def test_only_the_fits_first_candidate_probes_a_refusals_minimum():
    """The first candidate (the user's own budget) probes the trade-off curve for a refusal's
    minimum, which the fit reads to choose its next budget; a re-asked candidate's refusal only
    moves the bracket, so it skips the probe (27 s of a 12-layer GPT-2's fit)."""
    backend = remat_pass.backend(budget="1MB", budget_kind="peak", inner="inductor", chunk_loss=False)
    backend._fitting.seen = set()
    backend._fitting.asked = None
    first = backend._options_now()
    backend._fitting.asked = 900_000
    again = backend._options_now()
    backend._fitting.seen = None
    assert first.probe_minimum and not again.probe_minimum and again.budget.nbytes == 900_000
    assert backend._options_now().probe_minimum


def test_a_restarted_fit_takes_the_candidate_it_chose_before():
    """``refit``: the candidate an earlier fit chose is compiled at the budget it was asked at;
    answered by Inductor's caches (the very program measured before), its stored measurement
    stands and no step runs; compiled anew, it is measured, and a measurement over the budget
    (or a refusal) sends the fit back to the start."""
    from remat_pass.runtime.inductor_fit import FitOutcome, refit

    compiler = Compiler(lambda asked: asked)
    outcome = FitOutcome(target=B, asked=970_000, measured_bytes=960_000)

    def no_step(compiled, inputs):
        raise AssertionError("a step ran")

    chosen = refit(compiler, [], outcome, measure=no_step, answered_by_caches=lambda: True)
    assert compiler.asked == [970_000] and chosen.measured_bytes == 960_000 and chosen.plan.budget_bytes == B
    assert refit(compiler, [], outcome, measure=lambda c, i: 990_000).measured_bytes == 990_000
    assert refit(compiler, [], outcome, measure=lambda c, i: B + 1) is None
    assert refit(Compiler(lambda asked: asked, floor=2 * B), [], outcome) is None
