"""Fourteen more Hugging Face families (``benchmarks.hf_families.MORE_FAMILIES``), dropout on, against eager.

Probed on 2026-12-07 as a user would bring them, none in view when the capture and rewrite were
written: a mixture of experts (Mixtral), ALiBi (Bloom), a parallel block (GPT-J), multi-query
attention (GPT-BigCode), one layer's weights shared by every layer (ALBERT), DistilBERT, disentangled
attention (DeBERTa-v2), logit softcapping with a sliding window (Gemma-2), a factorized embedding
(ELECTRA); then, from a second probe of fifteen more (all passed), experts beside a gated shared
expert (Qwen2-MoE), local attention with a tied head (GPT-Neo), clipped queries, keys and values (OLMo),
norms after attention and MLP (OLMo2) and a sequence pooled between blocks (Funnel). 2 layers, hidden 32, dropout 0.1, the same seed before
each step. Each at a tight saved-bytes budget and at a peak budget of 0.7 of eager's measured peak:
eager's loss and gradients bit for bit, and the budget kept as measured: twenty-eight tests, about a
minute and a half here, so they run by default. Then each but Funnel (whose plain Inductor compile takes
minutes) under the registered backend on Inductor against plain torch.compile, and OLMo2 under a peak budget
on Inductor (``-m slow``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import remat_pass
from benchmarks.hf_families import MORE_FAMILIES
from benchmarks.models import LossOf
from benchmarks.vs_checkpoint import measured_step

from .helpers import eager_reference, fitted_against_torch_compile, optimize_and_step
from .zoo_models import VOCAB, _LogitsOf, _lm_loss

pytest.importorskip("transformers")

SEQ, BATCH, DROPOUT, TIGHT, PEAK_SHARE = 16, 2, 0.1, 0.3, 0.7


def _model(name: str) -> torch.nn.Module:
    return MORE_FAMILIES[name](2, 32, SEQ, VOCAB, 4, dropout=DROPOUT)


@pytest.mark.parametrize("name", list(MORE_FAMILIES))
def test_family_gives_eagers_step_at_a_tight_saved_bytes_budget(name):
    torch.manual_seed(0)
    model = _LogitsOf(_model(name)).train()
    inputs, loss_fn = (torch.randint(0, VOCAB, (BATCH, SEQ)),), _lm_loss(torch.randint(0, VOCAB, (BATCH, SEQ)))
    expected = eager_reference(model, inputs, loss_fn)
    optimized, actual, budget = optimize_and_step(model, inputs, loss_fn, TIGHT, fallback=TIGHT)
    assert torch.equal(actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys()
    assert all(torch.equal(actual.grads[k], expected.grads[k]) for k in expected.grads), "gradients differ"
    plan = optimized.plan
    assert plan.recomputed and actual.saved_bytes == plan.kept_bytes
    assert actual.saved_bytes <= (budget * plan.keep_all_bytes if isinstance(budget, float) else budget)


@pytest.mark.parametrize("name", list(MORE_FAMILIES))
def test_family_keeps_a_peak_budget_as_measured(name):
    """Budget 0.7 of eager's measured activation peak (after a warm-up step): the optimized step peaks
    within it at the allocator, with eager's gradients bit for bit (same dropout masks)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    model = LossOf(_model(name), torch.randint(0, VOCAB, (BATCH, SEQ))).train()
    model(tokens).backward()  # one-time allocations are no activations
    torch.manual_seed(1)
    eager = measured_step(model, model, tokens)
    budget = int(PEAK_SHARE * eager["peak_bytes"])
    optimized = remat_pass.optimize(model, budget, budget_kind="peak", example_inputs=(tokens,))
    torch.manual_seed(1)
    measured = measured_step(optimized, model, tokens)
    assert measured["peak_bytes"] <= budget, (measured["peak_bytes"], budget)
    assert len(measured["grads"]) == len(eager["grads"])
    assert all(torch.equal(a, b) for a, b in zip(measured["grads"], eager["grads"])), "gradients differ"


INDUCTOR_TOLERANCE = 1e-4  # where remat saves other tensors than torch's partitioner, Inductor rounds differently


# Plain Inductor's compile of Funnel's backward sits in sympy (Inductor's CPU tiling) for minutes on this machine:
# torch's, before remat_pass is involved (the second probe waited 330 s at h64), so it is left out here.
INDUCTOR_TOO_SLOW = ("funnel",)


@pytest.mark.slow
@pytest.mark.backend_default
@pytest.mark.parametrize("name", [name for name in MORE_FAMILIES if name not in INDUCTOR_TOO_SLOW])
def test_family_under_the_registered_backend_matches_torch_compile(name):
    """``torch.compile(model, backend="remat")`` (the default budget, on Inductor) against plain
    ``torch.compile``, the same seed before each step: the loss, and every gradient within
    ``INDUCTOR_TOLERANCE`` of its largest entry (bit for bit on 6 of these 9; Mixtral, DeBERTa-v2, Gemma-2 differ by 1-2e-7:
    ``benchmarks/results/backend_vs_torch_compile/bit_equality.txt``)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    model = LossOf(_model(name), torch.randint(0, VOCAB, (BATCH, SEQ))).train()
    reference = copy.deepcopy(model)
    losses = []
    for module, backend in ((reference, "inductor"), (model, "remat")):
        torch.manual_seed(7)
        loss = torch.compile(module, backend=backend)(tokens)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=INDUCTOR_TOLERANCE, atol=0.0)
    for (key, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() <= INDUCTOR_TOLERANCE * max(q.grad.abs().max().item(), 1e-12), key


@pytest.mark.slow
@pytest.mark.backend_default
def test_a_peak_budget_on_inductor_gives_torch_compiles_gradients_where_saved_tensors_share_storage():
    """HF OLMo2 (2 layers, h64, s32, dropout 0.1) under the backend at 0.8 of plain torch.compile's measured
    peak: the fitted plan keeps a layer's input and the q/k/v matmuls' views of it. With AOTAutograd's
    donated buffers Inductor reused that input's buffer in backward while the views were still to be
    read, and layer 0's q/k/v weight gradients came out wrong (a held-out probe); now the loss is
    torch.compile's and the gradients within ``INDUCTOR_TOLERANCE`` (the embedding's is not bit-stable
    in torch.compile's own steps), within the budget as measured."""
    torch.manual_seed(0)
    tokens = torch.randint(3, 256, (2, 32))
    model = LossOf(MORE_FAMILIES["olmo2"](2, 64, 32, 256, 4, dropout=DROPOUT), torch.randint(0, 256, (2, 32))).train()
    fitted_against_torch_compile(model, (tokens,), scale=0.8, tolerance=INDUCTOR_TOLERANCE)
