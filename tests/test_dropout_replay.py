"""Dropout replay: measured per device, dtype and probability, never assumed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass.annotate import dropout_replay
from remat_pass.annotate.dropout_replay import replay, replay_is_exact

from .helpers import eager_reference, run_step


class _DropoutMLP(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.up, self.down, self.p = nn.Linear(16, 64), nn.Linear(64, 16), p

    def forward(self, x):
        return self.down(nn.functional.dropout(torch.tanh(self.up(x)), self.p, training=True))


def test_the_probe_agrees_with_the_kernel_and_leaves_the_rng_alone():
    for dtype in (torch.float32, torch.bfloat16):
        for p in (0.1, 0.25, 0.5):
            x = torch.randn(5000, dtype=dtype)
            output, mask = torch.ops.aten.native_dropout.default(x, p, True)
            state = torch.random.get_rng_state()
            verdict = replay_is_exact("cpu", dtype, p)
            assert torch.equal(state, torch.random.get_rng_state())
            if verdict:  # where the probe says exact, other inputs replay exactly too
                assert torch.equal(output, replay(x, mask, p))
    assert replay_is_exact("cpu", torch.float32, 0.1)  # aten's CPU kernel: input * mask * scale
    assert replay_is_exact("meta", torch.float32, 0.1) and not replay_is_exact("meta", torch.bfloat16, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_do_not_depend_on_whether_the_output_replays(dtype):
    """Against the keep-all plan of the same graph (in bf16 AOTAutograd's graph itself rounds
    differently from eager, replay or not) and, in fp32, against eager."""
    torch.manual_seed(0)
    model = _DropoutMLP(0.1).to(dtype)
    inputs = (torch.randn(8, 16, dtype=dtype),)

    def loss_fn(out, x):
        return out.float().square().mean()

    expected = eager_reference(model, inputs, loss_fn)
    keep_all = run_step(model, remat_pass.optimize(model, budget=1.0, budget_kind="saved"), inputs, loss_fn)
    optimized = remat_pass.optimize(model, budget=0.2, budget_kind="saved", on_infeasible="clamp")
    actual = run_step(model, optimized, inputs, loss_fn)
    assert optimized.plan.recomputed
    references = [keep_all, expected] if dtype == torch.float32 else [keep_all]
    for reference in references:
        assert torch.equal(actual.loss, reference.loss)
        for name, grad in reference.grads.items():
            assert torch.equal(actual.grads[name], grad), name


def test_an_inexact_replay_keeps_the_output(monkeypatch):
    """Where the probe finds other bits, nothing is rebuilt: the output itself is kept."""
    torch.manual_seed(0)
    model, x = _DropoutMLP(0.1), torch.randn(8, 16)
    exact = remat_pass.optimize(model, budget=1e-9, budget_kind="saved", on_infeasible="clamp", example_inputs=(x,))
    monkeypatch.setattr(dropout_replay, "replay_is_exact", lambda device, dtype, p: False)
    kept = remat_pass.optimize(model, budget=1e-9, budget_kind="saved", on_infeasible="clamp", example_inputs=(x,))
    # Without replay the 4-byte output must stay; with it only the 1-byte mask does.
    assert kept.plan.kept_bytes > exact.plan.kept_bytes
