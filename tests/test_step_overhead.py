"""What a training call of an ``optimize``d module does once its graphs are compiled (issue 35).

On a small model a step takes a few milliseconds, so per-call work of ours shows in the step
time (benchmarks/VS_INDUCTOR.md, "Step overhead"). These tests pin the behaviour, not the time:
a steady-state call builds no config patch, binds no signature, compiles nothing and plans
nothing; the checkpoint flag is still on while dynamo runs; and with ``inner="inductor"`` both
the forward and the backward that run are Inductor's compiled graphs.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch._dynamo.config as dynamo_config
from torch._dynamo.utils import counters

import remat_pass
from remat_pass.capture.inputs import canonical
from remat_pass.compat import capture_config

from .models import make_case

FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
needs_flag = pytest.mark.skipif(not hasattr(dynamo_config, FLAG), reason="this torch has no such dynamo setting")


class _Counting:
    """Counts calls of a function it replaces (monkeypatch target), then calls it."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


def _train_step(module, inputs, loss_fn):
    for p in module.parameters():
        p.grad = None
    loss = loss_fn(module(*inputs), *inputs)
    loss.backward()
    return loss


@needs_flag
def test_the_checkpoint_flag_is_on_inside_and_restored_after():
    assert getattr(dynamo_config, FLAG) is False
    with capture_config():
        assert getattr(dynamo_config, FLAG) is True
        with capture_config():  # already on: nothing to change
            assert getattr(dynamo_config, FLAG) is True
        assert getattr(dynamo_config, FLAG) is True
    assert getattr(dynamo_config, FLAG) is False
    with pytest.raises(ValueError), capture_config():
        raise ValueError("restored on the way out of an error too")
    assert getattr(dynamo_config, FLAG) is False


def test_hugging_faces_warning_once_is_ignored_inside_and_restored_after():
    import logging

    pytest.importorskip("transformers")  # it sets Logger.warning_once
    before = set(dynamo_config.ignore_logger_methods)
    with capture_config():
        assert logging.Logger.warning_once in dynamo_config.ignore_logger_methods
        assert before <= dynamo_config.ignore_logger_methods
    assert dynamo_config.ignore_logger_methods == before


@needs_flag
def test_a_steady_state_call_patches_no_config_binds_nothing_and_compiles_nothing(monkeypatch):
    """``config.patch`` built a class per call (~50 us); binding the call to forward's signature
    ~5 us. Neither is needed on a call of positional tensors whose graph is compiled."""
    model, inputs, loss_fn = make_case("mlp")
    optimized = remat_pass.optimize(model, budget=0.5)
    _train_step(optimized, inputs, loss_fn)
    plans, frames = len(optimized._backend.plans), counters["frames"]["ok"]
    seen = {}

    def observe(*args):
        seen["flag"] = getattr(dynamo_config, FLAG)
        return compiled(*args)

    compiled = optimized._compiled
    object.__setattr__(optimized, "_compiled", observe)
    patches = _Counting(type(dynamo_config).patch)
    binds = _Counting(inspect.Signature.bind)
    monkeypatch.setattr(type(dynamo_config), "patch", patches)
    monkeypatch.setattr(inspect.Signature, "bind", binds)
    _train_step(optimized, inputs, loss_fn)
    assert seen == {"flag": True} and getattr(dynamo_config, FLAG) is False
    assert patches.calls == 0 and binds.calls == 0
    assert len(optimized._backend.plans) == plans and counters["frames"]["ok"] == frames  # no recompile
    assert optimized.plan is optimized._backend.plans[-1]


def test_positional_calls_are_canonical_as_given_and_keywords_still_bind():
    def forward(x, y=None, *, scale=1.0):
        return x

    signature = inspect.signature(forward)
    x, y = torch.ones(1), torch.zeros(1)
    assert canonical(signature, (x, y), {}) == ((x, y), {})
    assert canonical(signature, (x,), {"y": y}) == ((x, y), {})
    assert canonical(signature, (), {"x": x, "scale": 2.0}) == ((x,), {"scale": 2.0})
    assert canonical(signature, (x,), {"wrong": 1}) == ((x,), {"wrong": 1})  # the model raises its own error


@pytest.mark.backend_default
def test_inductor_runs_the_forward_and_the_backward_and_compiles_once():
    """With ``inner="inductor"`` each training step runs two Inductor graphs, the forward and
    the backward (neither eager), and later steps compile nothing again; the gradients equal
    ``torch.compile``'s own (Inductor without remat) bit for bit."""
    model, inputs, loss_fn = make_case("mlp")
    reference = copy.deepcopy(model)
    optimized = remat_pass.optimize(model, budget=1.0, budget_kind="saved", inner="inductor")
    _train_step(optimized, inputs, loss_fn)
    frames, plans = counters["frames"]["ok"], len(optimized._backend.plans)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss = _train_step(optimized, inputs, loss_fn)
    names = [event.name for event in profile.events()]
    assert sum(name.startswith("## Call CompiledFxGraph") for name in names) == 2
    assert "CompiledFunctionBackward" in names
    assert counters["frames"]["ok"] == frames and len(optimized._backend.plans) == plans
    expected = _train_step(torch.compile(reference), inputs, loss_fn)
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


class _WithLoss(torch.nn.Module):
    """A language model and its cross-entropy in one module: the loss inside the compiled step."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())


@pytest.mark.backend_default
def test_the_compiled_forward_keeps_no_one_hot_of_the_targets():
    """Inductor's joint-graph patterns rewrite cross-entropy's backward into ``where(eq(iota,
    target), -1, 0)``; the ``eq`` is backward's (eager and torch.compile compute it there), so
    even keep-all saves no (tokens, vocab) mask from the forward (on the benchmarks' GPT it cost
    the compiled forward 0.15 ms a step: 0.17 ms for the loss kernel against torch's 0.02 ms).
    The step still equals torch.compile's own, dropout included, bit for bit."""
    model, (tokens,), _ = make_case("gpt")
    targets = torch.randint(0, int(tokens.max()) + 1, tokens.shape)
    step, reference = _WithLoss(model), _WithLoss(copy.deepcopy(model))
    optimized = remat_pass.optimize(step, budget=1.0, budget_kind="saved", inner="inductor")
    loss_of = lambda out, *inputs: out  # noqa: E731 - the module returns its loss
    torch.manual_seed(3)
    loss = _train_step(optimized, (tokens, targets), loss_of)
    plan = optimized.plan
    # Keep-all recomputes only what Inductor fuses for free (planning.fused_free): no FLOPs.
    assert "gather.default" in {v.op for v in plan.problem.values}
    assert all(plan.problem.values[i].flops == 0 for i in plan.recomputed)
    assert not [plan.problem.values[i].name for i in plan.kept if plan.problem.values[i].op.startswith("eq.")]
    torch.manual_seed(3)
    expected = _train_step(torch.compile(reference), (tokens, targets), loss_of)
    assert torch.equal(loss, expected)
    for (name, p), q in zip(step.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
