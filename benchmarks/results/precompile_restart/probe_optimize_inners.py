"""optimize(...) under torch's precompile, inner eager and inductor: a first process, then a restarted one.

Run from the repository root (the output is probe_optimize_inners.txt beside this file):

    for inner in eager inductor; do
      export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PLANS=$(mktemp -d) TORCH_CACHING_PRECOMPILE=1
      for run in first second; do
        PYTHONPATH=. python benchmarks/results/precompile_restart/probe_optimize_inners.py $run $inner 2>&1 | grep -E "step|saved|Backend"
      done
    done

and once more for inner=inductor with the restarted process given another budget (`... second inductor 0.3`,
grepping "UserWarning" too).

Shows: with inner="eager" precompile has no entry ("Backend not found" at the save) and the restart
traces again; with inner="inductor" the restart runs the saved step, its plan read back from the plan
cache; given another budget, it still runs the saved step (torch keys it by the function alone), and
remat_pass warns at the user's line, its plan unknown.
"""
import os
import sys
import time
import warnings

import torch
import torch.nn as nn

import remat_pass
from remat_pass.examples import GPTConfig, gpt_example, lm_loss

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*stores the compiled step")
mode, inner = sys.argv[1], sys.argv[2]
budget = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5  # another budget in the restarted process: warned


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(tokens), targets)


config = GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab_size=256, dropout=0.0)
model, tokens, targets = gpt_example(config, batch=2)
optimized = remat_pass.optimize(WithLoss(model), budget=budget, inner=inner, plan_cache=os.environ["PLANS"])
began = time.perf_counter()
optimized(tokens, targets).backward()
print(f"{mode} optimize inner={inner}: first step {time.perf_counter() - began:.2f}s, "
      f"plan known: {optimized.plan is not None}")
if mode == "first":
    torch.compiler.save_cache_artifacts()
    print("saved torch's precompile artifacts")
