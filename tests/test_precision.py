"""Precision: fp32/fp64 bit-exact, bf16 (autocast or a bf16 model) exact against the same graph.

Rematerialization reruns the same aten ops on the same inputs, so at any budget the step must
be bit-identical to the un-rematerialized graph AOTAutograd traces
(``torch.compile(backend="aot_eager")``). Against eager:

* fp32 and fp64: bit-identical too (same kernels, same dropout masks).
* bf16: AOTAutograd itself differs from eager by a few rounding steps, with or without
  remat_pass, because it decomposes some ops eager runs as fused kernels (e.g. LayerNorm's
  backward) and so rounds bf16 intermediates at other places. bf16 keeps 8 significant bits,
  so one rounding step is at most 2**-7 of a value (0.8%); on these 2-layer models the
  observed worst case is about 1.6 steps of the largest gradient entry. We allow 4 steps:
  ``BF16_TOLERANCE = 4 * 2**-7`` of each gradient's largest entry (and of the loss).

Bytes: the measured saved bytes equal the prediction, dtype by dtype (a bf16 activation is
2 bytes an element, an fp32 one 4).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import solvers

from .helpers import StepResult, run_step
from .models import make_case
from .zoo_models import assert_random_ops_run_once, record_rewrites

BF16_TOLERANCE = 4 * 2**-7


def _autocast(fn):
    def call(*inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*inputs)

    return call


def _case(name: str, mode: str):
    """mode: "fp32", "fp64", "bf16" (the model and inputs in bf16) or "autocast" (fp32 model)."""
    model, inputs, loss_fn = make_case(name)
    dtype = {"fp64": torch.float64, "bf16": torch.bfloat16}.get(mode)
    if dtype is not None:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    wrap = _autocast if mode == "autocast" else (lambda fn: fn)
    return model, inputs, loss_fn, wrap


def _reference(model, inputs, loss_fn, wrap, backend=None) -> StepResult:
    twin = copy.deepcopy(model)
    call = twin if backend is None else torch.compile(twin, backend=backend)
    return run_step(twin, wrap(call), inputs, loss_fn)


def _assert_bitwise(actual: StepResult, expected: StepResult) -> None:
    assert torch.equal(actual.loss, expected.loss), (actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        assert torch.equal(actual.grads[name], grad), f"gradient of {name} is not bit-identical"
    for name, buffer in expected.buffers.items():
        assert torch.equal(actual.buffers[name], buffer), f"buffer {name} is not bit-identical"


def _assert_within_bf16_steps(actual: StepResult, expected: StepResult) -> None:
    loss_scale = expected.loss.float().abs().item()
    assert abs(actual.loss.float().item() - expected.loss.float().item()) <= BF16_TOLERANCE * loss_scale
    for name, grad in expected.grads.items():
        difference = (actual.grads[name].float() - grad.float()).abs().max().item()
        scale = grad.float().abs().max().item()
        assert difference <= BF16_TOLERANCE * scale, f"gradient of {name}: {difference} vs largest {scale}"


def _tight_budget(model, inputs, fraction: float = 0.2):
    """``fraction`` of keep-all, or the smallest feasible budget if that is more (bytes)."""
    probe = remat_pass.optimize(model, budget=1.0, example_inputs=inputs).plan
    torch._dynamo.reset()
    return max(int(fraction * probe.keep_all_bytes), solvers.min_feasible_bytes(probe.problem))


@pytest.mark.parametrize("name, mode", [
    ("gpt", "fp32"), ("cnn", "fp64"),
    pytest.param("gpt", "fp64", marks=pytest.mark.slow), pytest.param("cnn", "fp32", marks=pytest.mark.slow),
])
def test_full_precision_is_bit_identical_to_eager(name, mode):
    model, inputs, loss_fn, wrap = _case(name, mode)
    expected = _reference(model, inputs, loss_fn, wrap)
    budget = _tight_budget(model, inputs)
    optimized = remat_pass.optimize(model, budget=budget, budget_kind="saved")
    actual = run_step(model, optimized, inputs, loss_fn)
    assert optimized.plan.recomputed
    _assert_bitwise(actual, expected)
    assert actual.saved_bytes == optimized.plan.kept_bytes


def _bf16_params():
    params = []
    for mode in ("autocast", "bf16"):
        for name in ("gpt", "cnn", "mlp"):
            for budget in (1.0, 0.5, 0.2):
                default = (mode, name, budget) in (("autocast", "gpt", 0.2), ("bf16", "cnn", 0.5))
                slow = not default
                params.append(pytest.param(mode, name, budget, marks=pytest.mark.slow if slow else (),
                                           id=f"{mode}-{name}-{budget}"))
    return params


@pytest.mark.parametrize("mode, name, budget", _bf16_params())
def test_bf16_is_exact_against_the_traced_graph_and_close_to_eager(mode, name, budget, monkeypatch):
    model, inputs, loss_fn, wrap = _case(name, mode)
    eager = _reference(model, inputs, loss_fn, wrap)
    traced = _reference(model, inputs, loss_fn, wrap, backend="aot_eager")
    torch._dynamo.reset()
    records = record_rewrites(monkeypatch)
    optimized = remat_pass.optimize(model, budget=budget)
    try:
        actual = run_step(model, wrap(optimized), inputs, loss_fn)
        limit = budget * optimized.plan.keep_all_bytes
    except remat_pass.BudgetInfeasibleError as error:  # then plan at the smallest feasible budget
        assert error.min_bytes > budget * error.keep_all_bytes
        torch._dynamo.reset()
        records.clear()
        limit = error.min_bytes
        optimized = remat_pass.optimize(model, budget=limit, budget_kind="saved")
        actual = run_step(model, wrap(optimized), inputs, loss_fn)
    _assert_bitwise(actual, traced)  # remat adds no rounding of its own
    _assert_within_bf16_steps(actual, eager)
    assert actual.saved_bytes == optimized.plan.kept_bytes <= limit
    (record,) = records
    assert_random_ops_run_once(record)


def _saved_bytes_by_dtype(fn, exclude) -> Counter:
    """Like saved_activation_bytes, split by dtype: each storage once, at its full size."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, tuple[torch.dtype, int]] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in excluded and pointer != 0:
            storages[pointer] = (tensor.dtype, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    totals: Counter = Counter()
    for dtype, nbytes in storages.values():
        totals[dtype] += nbytes
    return totals


def _kept_bytes_by_dtype(record) -> Counter:
    problem = record.plan.problem
    totals: Counter = Counter()
    seen = set()
    for i in record.plan.kept:
        value = problem.values[i]
        if value.storage not in seen:
            seen.add(value.storage)
            totals[record.annotated.nodes[i].meta["val"].dtype] += problem.storage_bytes[value.storage]
    return totals


@pytest.mark.parametrize("budget", [pytest.param(1.0, marks=pytest.mark.slow), 0.3])
def test_autocast_bytes_are_right_dtype_by_dtype(budget, monkeypatch):
    """Under autocast the step keeps bf16 matmul outputs and fp32 norms/softmax: both counted right."""
    model, inputs, loss_fn, wrap = _case("gpt", "autocast")
    records = record_rewrites(monkeypatch)
    optimized = remat_pass.optimize(model, budget=budget)
    torch.manual_seed(0)
    measured = _saved_bytes_by_dtype(lambda: wrap(optimized)(*inputs), [*inputs, *model.parameters(), *model.buffers()])
    (record,) = records
    predicted = _kept_bytes_by_dtype(record)
    assert measured == predicted
    assert {torch.bfloat16, torch.float32} <= set(measured)  # matmul outputs; norms and softmax
    assert sum(measured.values()) == record.plan.kept_bytes


class _NormAfterMatmul(nn.Module):
    """Under autocast the matmul's output is bf16 and the norm's parameters fp32: a mixed norm."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 12)
        self.norm = {"layer": nn.LayerNorm(12), "group": nn.GroupNorm(3, 12), "batch": nn.BatchNorm1d(12)}[norm]
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.fc(x))))


@pytest.mark.parametrize("norm", ["batch", "layer", "group"])
def test_norm_statistics_under_autocast_are_counted_in_float32(norm):
    """aten's CPU batch, layer and group norm save their mean and inverse std in fp32 for a bf16
    input with fp32 parameters, while torch's fake tensors say bf16; the plan counts the real bytes."""
    torch.manual_seed(0)
    model, inputs = _NormAfterMatmul(norm), (torch.randn(6, 8),)
    loss_fn = lambda out, *_: out.square().mean()  # noqa: E731
    wrap = _autocast
    traced = _reference(model, inputs, loss_fn, wrap, backend="aot_eager")
    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, budget=1.0)
    actual = run_step(model, wrap(optimized), inputs, loss_fn)
    assert actual.saved_bytes == optimized.plan.kept_bytes == optimized.plan.keep_all_bytes
    _assert_bitwise(actual, traced)


def test_batch_norm_statistics_under_autocast_are_counted_in_float32():
    """The same for a CNN, against eager (no LayerNorm here: even the bf16 rounding matches)."""
    model, inputs, loss_fn, wrap = _case("cnn", "autocast")
    expected = _reference(model, inputs, loss_fn, wrap)
    optimized = remat_pass.optimize(model, budget=1.0)
    actual = run_step(model, wrap(optimized), inputs, loss_fn)
    assert actual.saved_bytes == optimized.plan.kept_bytes == optimized.plan.keep_all_bytes
    _assert_bitwise(actual, expected)
    assert actual.buffers["bn1.num_batches_tracked"].item() == 1
