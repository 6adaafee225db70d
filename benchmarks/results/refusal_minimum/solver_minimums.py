"""The minimum ``ilp_peak`` states when it refuses 0.85 of per-block checkpointing's peak, on the two
problems of ``python -m benchmarks.planning_time --solver-limits`` it refuses (HF Llama 8 layers h512,
HF GPT-2 6 layers h384; meta tensors, vocabulary 8192), at the default effort, then that minimum
asked for. Run from the repository root: ``PYTHONPATH=. python benchmarks/results/refusal_minimum/solver_minimums.py``.
"""

from __future__ import annotations

import time

from benchmarks.planning_time import baseline_peak, hf_problem
from remat_pass import solvers
from remat_pass.planning.effort import FAST_TIME_LIMIT, effort_options

for name, shape in (("llama", (8, 512, 512, 1)), ("gpt2", (6, 384, 256, 2))):
    problem = hf_problem(name, *shape)
    per_block = baseline_peak(problem, "per_block")
    options = effort_options("ilp_peak", FAST_TIME_LIMIT, False)
    began = time.perf_counter()
    try:
        solvers.solve(problem, int(0.85 * per_block), solver="ilp_peak", **options)
        print(f"{name}: 0.85 of per-block's peak planned")
        continue
    except solvers.BudgetInfeasibleError as error:
        stated, refused_in = error.min_bytes, time.perf_counter() - began
    began = time.perf_counter()
    plan = solvers.solve(problem, stated, solver="ilp_peak", **options)
    print(f"{name}: 0.85 of per-block's peak ({per_block} B) refused in {refused_in:.1f} s, stated minimum {stated} B "
          f"= {stated / per_block:.4f} of it; asked for, planned in {time.perf_counter() - began:.1f} s, peak "
          f"{plan.predicted_peak_bytes} B ({plan.predicted_peak_bytes / per_block:.4f}), recompute {plan.recompute_seconds:.6g} s",
          flush=True)
