"""The smallest budget a refused peak budget states, and whether it plans when passed.

Two tiny held-out Hugging Face models (random weights, dropout 0.1, the loss in the step; 2 layers,
hidden 32, sequence 16, batch 2, vocabulary 128), CPU fp32: Gemma-2 (eager attention, softcapping) and
DistilBERT. For each, eager's allocator peak, then ``optimize(..., budget_kind="peak")`` at each
budget given (fractions of that peak): refused with the minimum it states, or planned and measured;
then the stated minimum itself, passed back. Run from the repository root:

    PYTHONPATH=. python benchmarks/results/refusal_minimum/refusal_minimum.py gemma2:0.25,0.35 distilbert:0.35,0.45
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import transformers
from torch import nn
from torch.nn import functional as F

import remat_pass
from remat_pass.runtime.measure import peak_activation_bytes

VOCAB, SEQ, BATCH, HIDDEN = 128, 16, 2, 32


class LMLoss(nn.Module):
    def __init__(self, model: nn.Module, targets: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("targets", targets, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(input_ids=tokens).logits.flatten(0, -2), self.targets.flatten())


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    if name == "gemma2":
        config = transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.1,
            final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=8, query_pre_attn_scalar=8,
            bos_token_id=0, eos_token_id=1, pad_token_id=None)
        config._attn_implementation = "eager"
        model = transformers.Gemma2ForCausalLM(config)
    elif name == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=2 * HIDDEN, max_position_embeddings=64,
            dropout=0.1, attention_dropout=0.1, pad_token_id=0)
        model = transformers.DistilBertForMaskedLM(config)
    else:
        raise SystemExit(f"unknown model {name!r}")
    return LMLoss(model, targets).train(), (tokens,)


def measured_peak(step: nn.Module, owner: nn.Module, inputs: tuple[torch.Tensor]) -> int:
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    return peak_activation_bytes(lambda: step(*inputs).backward(), lambda: [p.grad for p in owner.parameters()])[1]


def attempt(model: nn.Module, inputs: tuple[torch.Tensor], budget: int, eager: int) -> int | None:
    """The stated minimum when refused, else None (planned and measured)."""
    copied = copy.deepcopy(model)
    began = time.perf_counter()
    try:
        optimized = remat_pass.optimize(copied, budget, budget_kind="peak", example_inputs=inputs, plan_cache=False)
    except remat_pass.BudgetInfeasibleError as error:
        torch._dynamo.reset()
        print(f"  budget {budget} ({budget / eager:.3f} of eager): refused in {time.perf_counter() - began:.1f} s, "
              f"stated minimum {error.min_bytes} ({error.min_bytes / eager:.3f})", flush=True)
        return error.min_bytes
    peak = measured_peak(optimized, copied, inputs)
    torch._dynamo.reset()
    print(f"  budget {budget} ({budget / eager:.3f} of eager): planned in {time.perf_counter() - began:.1f} s, "
          f"measured {peak} ({peak / eager:.3f}) {'<=' if peak <= budget else 'OVER'} the budget", flush=True)
    return None


def main() -> None:
    torch.set_num_threads(1)
    for spec in sys.argv[1:]:
        name, fractions = spec.split(":")
        model, inputs = build(name)
        warm = copy.deepcopy(model)
        warm(*inputs).backward()
        eager = measured_peak(warm, warm, inputs)
        print(f"{name}: eager peak {eager} bytes (torch {torch.__version__}, transformers {transformers.__version__})")
        for fraction in (float(f) for f in fractions.split(",")):
            stated = attempt(model, inputs, int(fraction * eager), eager)
            if stated is not None:
                print("  the stated minimum, passed back:", end="", flush=True)
                attempt(model, inputs, stated, eager)


if __name__ == "__main__":
    main()
