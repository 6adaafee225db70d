"""torch's own caches answering the remat backend's compiles (``capture.cached_compile``).

A second compile of the same graph under the same settings, after ``torch._dynamo.reset()`` (as in
a new process), is answered by AOTAutograd's cache: no joint graph traced, nothing planned, the
plan read back from the plan cache, the step the same bit for bit. Different settings, no plan
cache, or a plan cache without the plan: the compile plans, as before. The cases run with each inner
compiler: Inductor's, and the eager one, which AOTAutograd's cache stores where it bundles the
compiled graphs (``bundled_autograd_cache``, or torch's precompile: ``capture.eager_compile``).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from torch._dynamo.utils import counters

import remat_pass
from remat_pass.capture.cached_compile import graph_digest
from remat_pass.capture.inductor_compile import InductorPartitioner
from remat_pass.planning.budget import parse_budget
from remat_pass.runtime import dynamo_backend, peak_fitting
from remat_pass.runtime.inductor_fit import plan_identity

from .helpers import run_step
from .models import make_case


def _planned_joint_graphs(monkeypatch) -> list[object]:
    """The joint graphs the backend plans from here on."""
    planned: list[object] = []
    plan = dynamo_backend.plan_joint_graph

    def counting(joint, options):
        planned.append(joint)
        return plan(joint, options)

    monkeypatch.setattr(dynamo_backend, "plan_joint_graph", counting)
    return planned


@pytest.fixture(params=["inductor", "eager"])
def inner(request):
    """The inner compiler; the eager one with AOTAutograd's cache bundling the compiled graphs."""
    if request.param == "inductor":
        yield "inductor"
        return
    with torch._functorch.config.patch(bundled_autograd_cache=True):
        yield "eager"


def _compiled_step(model, inputs, loss_fn, inner="inductor", **options):
    backend = remat_pass.backend(inner=inner, chunk_loss=False, **options)
    result = run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    torch._dynamo.reset()  # what a new process starts from: only the caches on disk remain
    return backend, result


def test_a_second_compile_of_the_same_graph_and_settings_plans_nothing(tmp_path, monkeypatch, inner):
    model, inputs, loss_fn = make_case("mlp")
    planned = _planned_joint_graphs(monkeypatch)
    first, expected = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path)
    assert len(planned) == 1 and len(first.plans) == 1

    hits = counters["aot_autograd"]["autograd_cache_hit"]
    second, actual = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path)
    assert len(planned) == 1, "the second compile traced and planned the joint graph again"
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1
    assert [plan_identity(p) for p in second.plans] == [plan_identity(p) for p in first.plans]
    assert torch.equal(actual.loss, expected.loss)
    assert all(torch.equal(actual.grads[name], grad) for name, grad in expected.grads.items())

    # Another budget is another compile: planned, not answered by the first one's cache entry.
    _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.3, plan_cache=tmp_path)
    assert len(planned) == 2


def test_a_cache_entry_without_its_plan_is_compiled_again_and_planned(tmp_path, monkeypatch, inner):
    """AOTAutograd's cache on disk outlives an emptied plan cache: such a hit is not taken, since
    the backend would have a program and no plan for it."""
    model, inputs, loss_fn = make_case("mlp")
    planned = _planned_joint_graphs(monkeypatch)
    _, expected = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path / "a")
    backend, actual = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path / "b")
    assert len(planned) == 2 and len(backend.plans) == 1
    assert all(torch.equal(actual.grads[name], grad) for name, grad in expected.grads.items())


def test_a_cache_entry_without_its_plan_is_never_paired_with_a_plan_made_again(tmp_path, monkeypatch, inner):
    """The plan made again for such a hit may differ from the program in Inductor's caches (the
    searches are time-limited; here the planner is made to give another plan). The compile made
    again goes under a new identity, so a later process (this plan cache, the same Inductor caches)
    runs the program of the plan it reads back, not the first process's program."""
    from remat_pass.runtime import dynamo_backend as backend_module
    from remat_pass.runtime.plan_cache import Renewed, PlanCache

    model, inputs, loss_fn = make_case("mlp")
    _, first = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path / "a")
    plan = backend_module.plan_joint_graph
    monkeypatch.setattr(backend_module, "plan_joint_graph",  # another plan for the same compile identity
                        lambda joint, options: plan(joint, dataclasses.replace(options, budget=parse_budget(0.1))))
    again, second = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path / "b")
    assert second.saved_bytes < first.saved_bytes, "the plan made again should keep less"
    monkeypatch.setattr(backend_module, "plan_joint_graph", plan)
    later, third = _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=tmp_path / "b")
    assert [plan_identity(p) for p in later.plans] == [plan_identity(p) for p in again.plans]
    assert third.saved_bytes == second.saved_bytes, "a hit ran the first process's program with the new plan"
    assert any(isinstance(PlanCache(tmp_path / "b").get_compiled(path.stem, count=False), Renewed)
               for path in (tmp_path / "b" / "compiled").glob("*.pickle"))


def test_without_a_plan_cache_inductors_caches_never_answer(monkeypatch, inner):
    model, inputs, loss_fn = make_case("mlp")
    planned = _planned_joint_graphs(monkeypatch)
    for _ in range(2):
        _compiled_step(copy.deepcopy(model), inputs, loss_fn, inner, budget=0.5, plan_cache=False)
    assert len(planned) == 2


def test_the_identity_names_the_graph_and_every_planning_input(tmp_path):
    def identity(**options):
        return remat_pass.backend(inner="inductor", **options).compiled_identity("graph")

    base = identity(budget=0.5, plan_cache=tmp_path)
    assert base == identity(budget=0.5, plan_cache=tmp_path / "elsewhere")  # where the cache is: not an input
    assert base != identity(budget=0.4, plan_cache=tmp_path)
    assert base != identity(budget=0.5, plan_cache=tmp_path, solver="fast")
    assert base != remat_pass.backend(budget=0.5, inner="inductor", plan_cache=tmp_path).compiled_identity("other")
    assert identity(budget=0.5, plan_cache=False) is None

    tokens = torch.zeros(2, 3)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 4))
    assert graph_digest(gm, [tokens]) != graph_digest(gm, [torch.zeros(2, 4)])
    assert graph_digest(gm, [tokens]) != graph_digest(gm, [tokens.requires_grad_()])


def test_inductor_pickles_the_partitioner_as_its_identity_alone():
    """Inductor pickles its config into cache keys and deep-copies it when patched; the planner
    the partitioner closes over cannot be pickled, and need not be: the identity stands for it."""
    partitioner = InductorPartitioner(lambda *args, **kwargs: None, "abc")
    assert copy.deepcopy(partitioner) is partitioner
    copied = pickle.loads(pickle.dumps(partitioner))
    assert copied.uuid() == "abc"
    with pytest.raises(RuntimeError, match="no planner"):
        copied(None, [])


@pytest.mark.slow
def test_a_fitted_peak_budget_is_fitted_again_from_the_caches(tmp_path, monkeypatch):
    """Under a peak budget each fitting candidate is a compile of its own. Where a fit ended is
    stored: a second run compiles that candidate alone, answered by Inductor's caches, measures
    it once, and runs it: the same plan, within the budget, nothing planned. If it no longer
    measures within the budget, the fit runs from the start (each candidate answered by the caches)."""
    model, inputs, loss_fn = make_case("gpt")
    planned = _planned_joint_graphs(monkeypatch)
    budget = 160_000
    first, expected = _compiled_step(copy.deepcopy(model), inputs, loss_fn, budget=budget, budget_kind="peak",
                                     plan_cache=tmp_path)
    made = len(planned)
    assert made >= 1
    assert made >= 2, "the budget should take more than one candidate to fit"
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    second, actual = _compiled_step(copy.deepcopy(model), inputs, loss_fn, budget=budget, budget_kind="peak",
                                    plan_cache=tmp_path)
    assert len(planned) == made
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1  # the chosen candidate alone
    assert [plan_identity(p) for p in second.plans] == [plan_identity(p) for p in first.plans]
    assert all(torch.equal(actual.grads[name], grad) for name, grad in expected.grads.items())

    monkeypatch.setattr(peak_fitting, "refit", lambda *args, **kwargs: None)  # as if it measured over the budget now
    third, _ = _compiled_step(copy.deepcopy(model), inputs, loss_fn, budget=budget, budget_kind="peak",
                              plan_cache=tmp_path)
    assert len(planned) == made and counters["aot_autograd"]["autograd_cache_hit"] > hits + 2
    assert [plan_identity(p) for p in third.plans] == [plan_identity(p) for p in first.plans]


def test_a_refused_compile_is_refused_again_without_tracing(tmp_path, monkeypatch, inner):
    """A refusal leaves nothing in Inductor's caches; it is stored beside the plans and raised
    again, message and minimum as before, with nothing traced or planned."""
    model, inputs, loss_fn = make_case("mlp")
    planned = _planned_joint_graphs(monkeypatch)
    refusals = []
    for _ in range(2):
        backend = remat_pass.backend(budget="64B", budget_kind="saved", inner=inner, chunk_loss=False,
                                     plan_cache=tmp_path)
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
            run_step(copy.deepcopy(model), torch.compile(model, backend=backend), inputs, loss_fn)
        torch._dynamo.reset()
        refusals.append(raised.value.inner_exception)
    assert len(planned) == 1
    assert all(isinstance(error, remat_pass.BudgetInfeasibleError) for error in refusals)
    assert str(refusals[0]) == str(refusals[1]) and refusals[0].min_bytes == refusals[1].min_bytes


def test_a_graph_with_nothing_to_partition_is_compiled_once(tmp_path, caplog, inner):
    """Inputs that need gradients but outputs that do not: AOTAutograd compiles no backward and
    calls no partitioner. That is remembered, so a cache hit of it (a restart) is not taken for a
    hit whose plan is missing, which would compile it again. (The first run may itself be a hit
    of an entry an earlier test run left in Inductor's cache on disk; it is then compiled again
    once, and remembered.)"""
    import logging

    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    compiled_again = []
    for run in range(2):
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        backend = remat_pass.backend(budget=0.5, inner=inner, chunk_loss=False, plan_cache=tmp_path)
        compiled = torch.compile(lambda x: model(x).detach() * 2, backend=backend)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="remat_pass.capture.cached_compile"):
            out = compiled(x)
        torch._dynamo.reset()
        compiled_again.append(any("planning again" in r.getMessage() for r in caplog.records))
        assert torch.allclose(out, model(x).detach() * 2)
        assert not backend.plans
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1  # the second run was a cache hit
    assert not compiled_again[1]
