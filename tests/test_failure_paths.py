"""What cannot be traced or solved: clear errors that name the cause and the way out.

Capture: data-dependent control flow, an op torch.compile cannot run on fake tensors, logging
in forward, Python state mutated in forward, too many input signatures, double backward. The
backend path plans around graph breaks instead. What does trace but needs care: data-dependent
sizes (planned at their upper bound), ``.item()`` and NumPy. Solvers, through the public API: a
time limit that expires, a missing or broken ILP backend (simulated with monkeypatch).
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import sys

import pulp
import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import CaptureError, SolverError, SolverUnavailableError
from remat_pass.examples import GPT, GPTConfig
from remat_pass.solvers.mip import solve as _mip

from .helpers import assert_same_step, eager_reference, run_step
from .zoo_models import make_zoo

LOSS = lambda out, *inputs: out.square().mean()  # noqa: E731


class _TwoPieces(nn.Module):
    """Two pieces around a split point, each deep enough to plan at 60% of its keep-all bytes.

    Each piece is planned on its own. A piece cannot tell the step's inputs from the previous
    piece's activations, so it charges the inputs its backward needs (``x``, then ``h``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.tail = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    @staticmethod
    def _layers(layers: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = torch.tanh(layer(h))
        return h


class DataDependentBranch(_TwoPieces):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._layers(self.head, x)
        h = torch.tanh(h) if h.sum() > 0 else torch.sigmoid(h)
        return self._layers(self.tail, h)


class ExplicitGraphBreak(_TwoPieces):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._layers(self.head, x)
        torch._dynamo.graph_break()
        return self._layers(self.tail, torch.nn.functional.gelu(h))


class BreakAfterOneLinear(nn.Module):
    """The first piece's backward needs only its input ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.tail = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch._dynamo.graph_break()
        return _TwoPieces._layers(self.tail, h)


@torch.library.custom_op("remat_pass_tests::double_without_fake", mutates_args=())
def double_without_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class OpWithoutFakeImpl(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return double_without_fake(self.linear(x))


class CountsCallsInPython(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) * self.calls


class CountsCallsInABuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.tanh(self.linear(x)) * self.calls


def _inputs() -> tuple[torch.Tensor]:
    torch.manual_seed(3)
    return (torch.randn(4, 8),)


# --- capture --------------------------------------------------------------------------------------


def test_data_dependent_control_flow_names_the_cause_and_the_way_out():
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as raised:
        remat_pass.optimize(DataDependentBranch(), budget=0.5)(*_inputs())
    message = str(raised.value)
    assert "Data-dependent branching" in message
    assert "test_failure_paths.py" in message  # the user's line
    assert "remat_pass.backend" in message  # the way out
    assert isinstance(raised.value, RuntimeError)


def test_backend_plans_around_a_data_dependent_branch():
    torch.manual_seed(0)
    model = DataDependentBranch()
    inputs = _inputs()
    expected = eager_reference(model, inputs, LOSS)
    backend = remat_pass.backend(budget=0.6)
    actual = run_step(model, torch.compile(model, backend=backend), inputs, LOSS)
    assert_same_step(actual, expected)
    assert len(backend.plans) == 2  # before and after the branch
    assert all(plan.kept_bytes <= 0.6 * plan.keep_all_bytes for plan in backend.plans)
    _assert_piecewise_accounting(actual, backend.plans, inputs)


def test_backend_plans_each_piece_between_explicit_graph_breaks():
    torch.manual_seed(0)
    model = ExplicitGraphBreak()
    inputs = _inputs()
    with pytest.raises(CaptureError, match="graph_break"):
        remat_pass.optimize(model, budget=0.5)(*inputs)
    torch._dynamo.reset()
    expected = eager_reference(model, inputs, LOSS)
    backend = remat_pass.backend(budget=0.6)
    actual = run_step(model, torch.compile(model, backend=backend), inputs, LOSS)
    assert_same_step(actual, expected)
    assert len(backend.plans) == 2
    assert all(plan.recomputed for plan in backend.plans)
    _assert_piecewise_accounting(actual, backend.plans, inputs)


def test_registered_backend_with_explicit_graph_breaks():
    torch.manual_seed(0)
    model = ExplicitGraphBreak()
    inputs = _inputs()
    expected = eager_reference(model, inputs, LOSS)
    actual = run_step(model, torch.compile(model, backend="remat"), inputs, LOSS)
    assert_same_step(actual, expected)


def test_a_piece_whose_backward_needs_only_its_input_meets_any_fraction():
    """Each piece charges its inputs; a piece whose backward needs only its input (a Linear on
    the step's input, then a graph break) keeps exactly that in every plan. A fraction is of
    what a piece keeps beyond its own inputs (``pipeline.resolve_budget``), so 0.5 is met; it was
    refused while the input counted in the fraction (keep-all was then its minimum). A piece that
    truly cannot go below keep-all: tests/test_distributed.py's SplitNet."""
    from remat_pass.planning.pipeline import kept_input_bytes

    torch.manual_seed(0)
    model = BreakAfterOneLinear()
    inputs = _inputs()
    expected = eager_reference(model, inputs, LOSS)
    assert_same_step(run_step(model, torch.compile(model, backend="remat"), inputs, LOSS), expected)
    torch._dynamo.reset()
    backend = remat_pass.backend(budget=0.5)
    assert_same_step(run_step(model, torch.compile(model, backend=backend), inputs, LOSS), expected)
    first = backend.plans[0]
    assert first.kept_bytes == kept_input_bytes(first.problem, first) == first.keep_all_bytes > 0


def _assert_piecewise_accounting(actual, plans, inputs):
    """Each piece's input is charged where it is saved; the measurement excludes the step's
    own inputs, which the first piece charged too."""
    predicted = sum(plan.kept_bytes for plan in plans)
    input_bytes = sum(t.untyped_storage().nbytes() for t in inputs)
    assert actual.saved_bytes <= predicted <= actual.saved_bytes + input_bytes


@pytest.mark.slow
def test_torch_encoder_mask_without_is_causal_is_not_one_graph():
    """nn.TransformerEncoder compares a mask with a causal one unless told is_causal=True."""
    model, inputs, loss_fn = make_zoo("torch_encoder", declare_causal=False)
    with pytest.raises(CaptureError) as raised:
        remat_pass.optimize(model, budget=0.5)(*inputs)
    assert "data-dependent" in str(raised.value)
    torch._dynamo.reset()
    expected = eager_reference(model, inputs, loss_fn)
    actual = run_step(model, torch.compile(model, backend="remat"), inputs, loss_fn)
    assert_same_step(actual, expected)


def test_op_without_fake_implementation_names_the_op_and_the_fix():
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as raised:
        remat_pass.optimize(OpWithoutFakeImpl(), budget=0.5)(*_inputs())
    message = str(raised.value)
    assert "double_without_fake" in message and "no fake impl registered" in message
    assert "register_fake" in message


USER_LOGGER = logging.getLogger("remat_pass_tests.user_model")


class LogsInForward(nn.Module):
    """A logging call in forward (optimize leaves only Hugging Face's ``warning_once`` untraced itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        USER_LOGGER.warning("forward called")
        return torch.tanh(self.linear(x))


def test_logging_in_forward_is_a_graph_break_unless_dynamo_ignores_it():
    torch.manual_seed(0)
    model = LogsInForward()
    inputs = _inputs()
    with pytest.raises(CaptureError, match="logging.Logger"):
        remat_pass.optimize(model, budget=0.5)(*inputs)
    torch._dynamo.reset()
    expected = eager_reference(model, inputs, LOSS)
    with torch._dynamo.config.patch(ignore_logger_methods={logging.Logger.warning}):
        optimized = remat_pass.optimize(model, budget=0.5)
        actual = run_step(model, optimized, inputs, LOSS)
    assert_same_step(actual, expected)


def test_double_backward_is_refused_by_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimized = remat_pass.optimize(model, budget=0.5)
    gradients = torch.autograd.grad(optimized(*_inputs()).sum(), list(model.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        sum(g.square().sum() for g in gradients).backward()


class SelectsPositives(nn.Module):
    """``h[h > 0]``: an output whose size depends on the data (an unbacked symbol in the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        selected = torch.tanh(h[h > 0])
        return torch.tanh(self.second(h)).sum() + (selected * 2).sum()


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.2])
def test_data_dependent_sizes_are_planned_at_their_upper_bound(budget):
    """The plan cannot know how many elements ``h > 0`` selects: it counts the most there can be
    (all of them), so the measured bytes never exceed the prediction, nor the budget."""
    torch.manual_seed(0)
    model, inputs = SelectsPositives(), _inputs()
    loss_fn = lambda out, *_: out  # noqa: E731
    expected = eager_reference(model, inputs, loss_fn)
    optimized = remat_pass.optimize(model, budget=budget)
    actual = run_step(model, optimized, inputs, loss_fn)
    assert_same_step(actual, expected)
    plan = optimized.plan
    assert actual.saved_bytes <= plan.kept_bytes <= budget * plan.keep_all_bytes
    selected = int((model.first(inputs[0]) > 0).sum())
    if budget == 1.0:  # keep-all holds the selected tanh output: counted at 32 elements, holds fewer
        assert plan.kept_bytes - actual.saved_bytes == 4 * (32 - selected)


class ItemAndNumpy(nn.Module):
    """``.item()`` and NumPy on a detached activation: traced by dynamo, no graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        scale = h.detach().abs().max().item() + float(h.detach().numpy().mean())
        return torch.tanh(self.second(h)) * scale


def test_item_and_numpy_in_forward_match_eager():
    torch.manual_seed(0)
    model, inputs = ItemAndNumpy(), _inputs()
    expected = eager_reference(model, inputs, LOSS)
    optimized = remat_pass.optimize(model, budget=0.5)
    actual = run_step(model, optimized, inputs, LOSS)
    assert_same_step(actual, expected)
    assert actual.saved_bytes == optimized.plan.kept_bytes


def test_python_counter_matches_eager_until_the_recompile_limit():
    """Dynamo replays ``self.calls += 1`` (once per call, as eager) but specializes on the int:
    every call is a new graph and a new plan, until the recompile limit, then a CaptureError
    that says so and how to avoid it."""
    torch.manual_seed(0)
    model = CountsCallsInPython()
    reference = copy.deepcopy(model)
    optimized = remat_pass.optimize(model, budget=0.5)
    inputs = _inputs()
    with torch._dynamo.config.patch(recompile_limit=3):
        for call in range(1, 4):
            expected = run_step(reference, reference, inputs, LOSS)
            actual = run_step(model, optimized, inputs, LOSS)
            assert_same_step(actual, expected)
            assert model.calls == reference.calls == call
        with pytest.raises(CaptureError) as raised:
            optimized(*inputs)
    message = str(raised.value)
    assert "recompile limit" in message and "self.calls += 1" in message and "tensor buffer" in message


def test_counter_in_a_buffer_is_one_graph_updated_once_per_call():
    torch.manual_seed(0)
    model = CountsCallsInABuffer()
    reference = copy.deepcopy(model)
    optimized = remat_pass.optimize(model, budget=0.5)
    inputs = _inputs()
    for call in range(1, 5):
        expected = run_step(reference, reference, inputs, LOSS)
        actual = run_step(model, optimized, inputs, LOSS)
        assert_same_step(actual, expected)
        assert model.calls.item() == call
    assert len(optimized.plans) == 1 and len(optimized._backend.plans) == 1  # planned once


def test_too_many_input_shapes_raise_a_capture_error_not_a_dynamo_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimized = remat_pass.optimize(model, budget=0.5)
    with torch._dynamo.config.patch(recompile_limit=2):
        for batch in (2, 3):
            optimized(torch.randn(batch, 8)).sum().backward()
        with pytest.raises(CaptureError) as raised:
            optimized(torch.randn(4, 8))
    assert "recompile limit" in str(raised.value) and "2 plans" in str(raised.value)


# --- solvers --------------------------------------------------------------------------------------


def _hard_case():
    """A 4-layer GPT whose ILP at 30% of keep-all takes CBC seconds to prove."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=32, layers=4, hidden=32, heads=2, dropout=0.1)
    tokens = torch.randint(0, 64, (2, 32))
    targets = torch.randint(0, 64, (2, 32))
    loss = lambda out, tokens: nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return GPT(config), (tokens,), loss


@pytest.mark.parametrize("backend", ["cbc", pytest.param("highs", marks=pytest.mark.slow)])
def test_expired_time_limit_returns_the_best_plan_with_its_gap(backend):
    model, inputs, loss_fn = _hard_case()
    expected = eager_reference(model, inputs, loss_fn)
    optimized = remat_pass.optimize(model, budget=0.3, time_limit=1e-3, backend=backend)
    try:
        actual = run_step(model, optimized, inputs, loss_fn)
    except SolverError as error:  # allowed: no plan at all within the limit, said clearly
        assert "time_limit" in str(error)
        return
    plan = optimized.plan
    assert plan.solver == "ilp" and plan.status in ("time_limit", "feasible", "optimal")
    if backend == "cbc" or plan.status != "optimal":  # CBC needs seconds here; HiGHS may be quick
        assert plan.status == "time_limit"  # the limit cut it short, and the status says so
        assert plan.gap is not None and plan.gap > 0, plan.gap
        assert "time_limit" in plan.summary() and f"{plan.gap:.2%}" in plan.summary()
    else:
        assert plan.gap == 0.0
    assert_same_step(actual, expected)  # a suboptimal plan is still exact
    assert actual.saved_bytes == plan.kept_bytes <= 0.3 * plan.keep_all_bytes


@pytest.fixture
def fresh_backend_probe():
    """The backend probe is cached per process; patched backends need it cleared both ways."""
    _mip._backend_works.cache_clear()
    yield
    _mip._backend_works.cache_clear()


def _without_highspy(monkeypatch):
    # What PuLP does when `import highspy` fails: HiGHS.available() is False.
    monkeypatch.setitem(sys.modules, "highspy", None)
    monkeypatch.setattr(pulp.HiGHS, "available", lambda self: False)


def _cbc_at(monkeypatch, path):
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", str(path))


def _failing_binary(tmp_path):
    script = tmp_path / "cbc"
    script.write_text("#!/bin/sh\necho 'cbc: cannot start' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _plan_mlp(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return remat_pass.optimize(model, budget=0.5, example_inputs=_inputs(), **options)


@pytest.mark.usefixtures("fresh_backend_probe")
def test_highs_requested_but_highspy_missing(monkeypatch):
    _without_highspy(monkeypatch)
    with pytest.raises(SolverUnavailableError) as raised:
        _plan_mlp(backend="highs")
    assert "pip install highspy" in str(raised.value)
    assert isinstance(raised.value, ImportError)


@pytest.mark.usefixtures("fresh_backend_probe")
def test_auto_falls_back_to_cbc_without_highspy(monkeypatch):
    _without_highspy(monkeypatch)
    optimized = _plan_mlp()
    assert optimized.plan.status == "optimal"


@pytest.mark.usefixtures("fresh_backend_probe")
@pytest.mark.parametrize("cbc", ["missing", "broken"])
def test_no_working_backend_says_what_to_install(monkeypatch, tmp_path, cbc):
    _without_highspy(monkeypatch)
    _cbc_at(monkeypatch, tmp_path / "no-such-cbc" if cbc == "missing" else _failing_binary(tmp_path))
    with pytest.raises(SolverUnavailableError) as raised:
        _plan_mlp()
    assert "pip install highspy" in str(raised.value) and "pulp" in str(raised.value)
    with pytest.raises(SolverUnavailableError) as raised:
        _plan_mlp(backend="cbc")
    assert "reinstall" in str(raised.value) and "pulp" in str(raised.value)


@pytest.mark.usefixtures("fresh_backend_probe")
def test_broken_cbc_does_not_matter_when_the_budget_needs_no_solver(monkeypatch, tmp_path):
    """Keep-all (budget 1.0) needs no ILP, so no backend is probed."""
    _without_highspy(monkeypatch)
    _cbc_at(monkeypatch, _failing_binary(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimized = remat_pass.optimize(model, budget=1.0, example_inputs=_inputs())
    assert not optimized.plan.recomputed and os.path.exists(pulp.PULP_CBC_CMD.pulp_cbc_path)


def test_an_option_the_chosen_planner_does_not_take_is_named_not_called_a_bug():
    """``exact_share`` belongs to the peak planner: with a saved-bytes budget the ILP is chosen."""
    import remat_pass
    from remat_pass import SolverOptionError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with pytest.raises(SolverOptionError, match="'ilp' planner.*no option 'exact_share'.*budget_kind='peak'"):
        remat_pass.optimize(model, budget=0.5, example_inputs=(torch.randn(4, 8),), exact_share=0.5)
