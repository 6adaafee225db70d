"""torch's precompile saves the program the backend returned (``capture.precompiled``).

With ``torch._dynamo.config.caching_precompile`` each Inductor compile records its AOTAutograd
entry under the Dynamo graph's backend id, and ``torch.compiler.save_cache_artifacts()`` saves
the last one recorded; a restarted process runs it without calling the backend. The backend
compiles several candidates for one graph (the peak fit) and returns the one it chose, which must
be the one saved; a graph it returns no Inductor program for (eager) must not be saved at all.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext

import remat_pass
from remat_pass.capture.precompiled import note_candidate, program_stored_as_returned
from remat_pass.runtime import dynamo_backend, peak_fitting
from remat_pass.runtime.inductor_fit import plan_identity

from .helpers import run_step
from .models import make_case

KEY = "__compiled_fn_remat_precompile_test"


def _held() -> object:
    artifact = PrecompileContext.serialize_artifact_by_key(KEY)
    return None if artifact is None else artifact.content


def _compile(content: str) -> object:
    """A stand-in for one Inductor compile: it records its entry, as AOTAutograd's cache does."""
    PrecompileContext.record_artifact(BackendCacheArtifact(KEY, content))
    program = SimpleNamespace(name=content)
    note_candidate(program)
    return program


@pytest.fixture
def precompile():
    """torch's precompile on for the test (``config.patch``: monkeypatch's undo would delete the entry)."""
    with torch._dynamo.config.patch(caching_precompile=True):
        yield


@pytest.fixture(autouse=True)
def _no_entry_left():
    PrecompileContext._backend_artifacts_by_key.pop(KEY, None)
    yield
    PrecompileContext._backend_artifacts_by_key.pop(KEY, None)


def test_the_returned_candidate_is_held_not_the_last_compiled():
    with program_stored_as_returned(SimpleNamespace(_backend_id=KEY)) as settle:
        chosen = _compile("fits the budget")
        _compile("measured over it")
        assert _held() == "measured over it"
        assert settle(chosen) is chosen
    assert _held() == "fits the budget"


def test_a_returned_program_without_an_entry_withdraws_the_graph():
    """An eager fallback after Inductor candidates: nothing of this graph may be saved."""
    with program_stored_as_returned(SimpleNamespace(_backend_id=KEY)) as settle:
        _compile("measured over the budget")
        settle(SimpleNamespace(name="eager"))
    assert _held() is None


def test_a_compile_that_recorded_nothing_is_not_given_the_previous_entry():
    with program_stored_as_returned(SimpleNamespace(_backend_id=KEY)) as settle:
        _compile("an earlier candidate")
        uncached = SimpleNamespace(name="compiled without AOTAutograd's cache")
        note_candidate(uncached)
        settle(uncached)
    assert _held() is None


def test_an_entry_recorded_before_the_call_is_left_alone():
    """A backend call that compiled nothing with Inductor changes nothing precompile holds (a lazily
    compiled backward records its entry after the call returns)."""
    PrecompileContext.record_artifact(BackendCacheArtifact(KEY, "recorded earlier"))
    with program_stored_as_returned(SimpleNamespace(_backend_id=KEY)) as settle:
        settle(SimpleNamespace(name="eager"))
    assert _held() == "recorded earlier"


def test_a_graph_without_a_backend_id_is_not_touched():
    with program_stored_as_returned(SimpleNamespace()) as settle:
        program = _compile("a candidate")
        assert settle(program) is program
    assert _held() == "a candidate"


def _saved_as_by_a_restarted_job(monkeypatch) -> None:
    """Save torch's precompile artifacts and reset Dynamo, as a job restarts; from here on the
    backend fails if it is called (a restarted step must run what precompile installs)."""
    torch.compiler.save_cache_artifacts()
    torch._dynamo.reset()

    def not_called(self, gm, example_inputs):
        raise AssertionError("the restarted step called the backend: precompile did not answer it")

    monkeypatch.setattr(dynamo_backend.RematBackend, "__call__", not_called)


def _forget_installed_steps(model: torch.nn.Module) -> None:
    """What precompile installs lives on the code objects and outlasts ``torch._dynamo.reset()``: left
    there, every later compile of this model class in the process would run it (a later test's
    eager-inner step ran an Inductor program installed so, with Inductor's dropout masks)."""
    for code in {type(module).forward.__code__ for module in model.modules()}:
        torch._C._dynamo.eval_frame._reset_precompile_entries(code)


def _assert_the_same_step(again, first) -> None:
    """The restarted step is the first process's program: its saved bytes, loss and gradients, bit for bit."""
    assert again.saved_bytes == first.saved_bytes
    assert torch.equal(again.loss, first.loss)
    assert all(torch.equal(again.grads[name], grad) for name, grad in first.grads.items())


@pytest.mark.slow
def test_a_restarted_process_runs_the_fits_choice_without_the_backend(tmp_path, monkeypatch, precompile):
    """End to end, in one process (``torch._dynamo.reset()`` in between): the fit compiles one more
    candidate after its choice (keep-everything, as a fit that went on past its choice would), the
    artifacts are saved, and the restarted step runs the chosen plan without calling the backend."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    fit_peak = peak_fitting.fit_peak
    last_compiled = []

    def fit_then_one_more(compile_at, inputs, **options):
        chosen = fit_peak(compile_at, inputs, **options)
        last_compiled.append(compile_at(10 * chosen.plan.budget_bytes, set())[1])  # keeps everything
        return chosen

    monkeypatch.setattr(peak_fitting, "fit_peak", fit_then_one_more)
    model, inputs, loss_fn = make_case("gpt")
    backend = remat_pass.backend(budget=160_000, budget_kind="peak", inner="inductor", chunk_loss=False,
                                 plan_cache=tmp_path / "plans")
    fitted = copy.deepcopy(model)
    compiled = torch.compile(fitted, backend=backend)
    run_step(fitted, compiled, inputs, loss_fn)  # compiles: what it holds meanwhile is not the step's
    first = run_step(fitted, compiled, inputs, loss_fn)
    assert len(backend.plans) == 1
    assert last_compiled[0].kept_bytes > backend.plans[0].kept_bytes, "the last compile should keep more"
    _saved_as_by_a_restarted_job(monkeypatch)
    restarted = copy.deepcopy(model)
    compiled = torch.compile(restarted, backend=remat_pass.backend(budget=160_000, budget_kind="peak"))
    try:
        run_step(restarted, compiled, inputs, loss_fn)
        again = run_step(restarted, compiled, inputs, loss_fn)
    finally:
        _forget_installed_steps(model)
    _assert_the_same_step(again, first)


def _restarted(model, budget):
    """A ``RematModule`` whose compiled step runs without calling remat_pass, as a precompiled one does."""
    optimized = remat_pass.optimize(model, budget=budget)
    object.__setattr__(optimized, "_compiled", model)
    return optimized


def test_a_restarted_step_reads_back_the_plan_it_was_compiled_with(precompile):
    """Under precompile a ``RematModule`` records its plans beside its settings when it compiles; a
    restarted one, whose step torch installs without calling remat_pass, reads them back as ``.plan``."""
    model, inputs, _ = make_case("mlp")
    first = remat_pass.optimize(model, budget=0.5)
    first(*inputs)
    restarted = _restarted(model, 0.5)
    restarted(*inputs)
    assert restarted.plan is not None and plan_identity(restarted.plan) == plan_identity(first.plan)


def test_a_restarted_step_planned_under_other_settings_is_warned_about(precompile):
    """torch keys the saved step by the function alone: a restart under another budget would run the
    old plan. No record under today's settings: a warning at the user's line, naming what to delete."""
    model, inputs, _ = make_case("mlp")
    remat_pass.optimize(model, budget=0.5)(*inputs)
    restarted = _restarted(model, 0.3)
    with pytest.warns(UserWarning, match="delete .*dynamo") as caught:
        restarted(*inputs)
        restarted(*inputs)  # said once
    assert len(caught) == 1 and caught[0].filename == __file__
    assert restarted.plan is None


def test_a_restarted_eager_step_runs_without_the_backend(tmp_path, monkeypatch, precompile):
    """``optimize``'s default inner compiler, eager, is stored too (``capture.eager_compile``: the
    rewritten graphs themselves in AOTAutograd's bundled entry): after the save the restarted step
    runs without calling remat_pass, with the first process's saved bytes, loss and gradients
    (dropout on), and reads its plan back. Before, precompile saved no entry for an eager graph
    ("Backend not found"), and the restart traced and planned again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, inputs, loss_fn = make_case("gpt")
    first_model = copy.deepcopy(model)
    optimized = remat_pass.optimize(first_model, budget=0.3, plan_cache=tmp_path / "plans")
    run_step(first_model, optimized, inputs, loss_fn)
    first = run_step(first_model, optimized, inputs, loss_fn)
    _saved_as_by_a_restarted_job(monkeypatch)
    restarted_model = copy.deepcopy(model)
    restarted = remat_pass.optimize(restarted_model, budget=0.3, plan_cache=tmp_path / "plans")
    try:
        again = run_step(restarted_model, restarted, inputs, loss_fn)
    finally:
        _forget_installed_steps(model)
    _assert_the_same_step(again, first)
    assert restarted.plan is not None and plan_identity(restarted.plan) == plan_identity(optimized.plan)
