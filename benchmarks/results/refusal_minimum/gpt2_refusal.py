"""The 12-layer HF GPT-2 (first-call step) refused at a fraction of checkpointing's peak (argv[1]): the minimum stated, then asked for.

PYTHONPATH=. python benchmarks/results/refusal_minimum/gpt2_refusal.py 0.3
"""

import sys
import time
from benchmarks.planning_time import first_call_model
from benchmarks.scaling import trace_timed
from remat_pass import solvers
from remat_pass.planning.effort import FAST_TIME_LIMIT, effort_options
model, tokens, budget = first_call_model()
problem = trace_timed(model, (tokens,), "cpu")[0]
target = int(budget * float(sys.argv[1]))
began = time.perf_counter()
try:
    solvers.solve(problem, target, solver="ilp_peak", **effort_options("ilp_peak", FAST_TIME_LIMIT, False))
    print("planned")
except solvers.BudgetInfeasibleError as e:
    print(f"12-layer HF GPT-2, {sys.argv[1]} of checkpointing's peak ({target} B): refused in {time.perf_counter()-began:.1f} s, stated {e.min_bytes} B = {e.min_bytes/budget:.4f} of checkpointing's peak")
    began = time.perf_counter()
    plan = solvers.solve(problem, e.min_bytes, solver="ilp_peak", **effort_options("ilp_peak", FAST_TIME_LIMIT, False))
    print(f"  the stated minimum asked for: planned in {time.perf_counter()-began:.1f} s, peak {plan.predicted_peak_bytes} B, recompute {plan.recompute_seconds:.4g} s ({plan.solver})")
