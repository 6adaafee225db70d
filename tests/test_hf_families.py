"""The benchmarks' nine extra Hugging Face families (``benchmarks.hf_families``) against eager.

Each family reshapes the decoder block differently (grouped- and multi-query attention, QK-norm,
parallel attention and MLP, partial rotary, GeGLU, learned positions) or is an encoder; none of
them was in view when the capture and rewrite were written. A step optimized at a tight budget
must give eager's loss bit for bit and its gradients, with the measured saved bytes equal to the
plan's and within the budget. At these sizes (2 layers, hidden 32) all nine take about 30 s.
"""

from __future__ import annotations

import pytest
import torch

import remat_pass
from remat_pass import BudgetInfeasibleError

from benchmarks.hf_families import FAMILIES, family_model

from .helpers import assert_same_step, eager_reference, run_step
from .zoo_models import VOCAB, _LogitsOf, _lm_loss  # the zoo's wrapper and loss, shared

pytest.importorskip("transformers")

SEQ, BATCH = 16, 2
TIGHT = 0.3


def _case(name: str):
    torch.manual_seed(0)
    model = _LogitsOf(family_model(name, layers=2, hidden=32, seq=SEQ, vocab=VOCAB, heads=4)).train()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (tokens,), _lm_loss(torch.randint(0, VOCAB, (BATCH, SEQ)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_eager_within_a_tight_budget(name):
    model, inputs, loss_fn = _case(name)
    expected = eager_reference(model, inputs, loss_fn)
    budget: float | int = TIGHT
    try:
        optimized = remat_pass.optimize(model, budget=budget, budget_kind="saved")
        actual = run_step(model, optimized, inputs, loss_fn)
    except BudgetInfeasibleError as error:  # the smallest feasible budget, as the error says
        assert error.min_bytes > TIGHT * error.keep_all_bytes
        torch._dynamo.reset()
        budget = error.min_bytes
        optimized = remat_pass.optimize(model, budget=budget, budget_kind="saved")
        actual = run_step(model, optimized, inputs, loss_fn)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss), "same ops: the loss must be bit-identical"
    plan = optimized.plan
    assert plan.recomputed, "a budget below keep-all must recompute something"
    assert actual.saved_bytes == plan.kept_bytes, "measured saved bytes must equal the prediction"
    limit = budget * plan.keep_all_bytes if isinstance(budget, float) else budget
    assert actual.saved_bytes <= limit
