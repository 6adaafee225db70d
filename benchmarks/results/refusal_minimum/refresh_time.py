"""The refresh pass from per-block's plan on the 12-layer HF GPT-2, without a deadline: how long it takes.

PYTHONPATH=. python benchmarks/results/refusal_minimum/refresh_time.py
"""

import time
from benchmarks.planning_time import first_call_model
from benchmarks.scaling import trace_timed
from remat_pass import solvers
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.peak.multiple_recompute import refresh_lowest
model, tokens, budget = first_call_model()
problem = trace_timed(model, (tokens,), "cpu")[0]
plan = solvers.solve(problem, None, solver="per_block")
t = time.perf_counter()
low, mem = refresh_lowest(problem, plan, None)
print(f"refresh_lowest without a deadline: {time.perf_counter()-t:.2f} s, {simulate_plan(problem, plan).peak_bytes} -> {mem.peak_bytes}, {len(low.refreshed)} refreshed")
