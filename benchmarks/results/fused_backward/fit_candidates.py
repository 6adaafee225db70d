"""Each candidate of one Inductor peak fit: what the planner's model holds at its peak (issue 35).

    PYTHONPATH=. python benchmarks/results/fused_backward/fit_candidates.py hf_llama 26259464

The 4-layer h256 model of ``benchmarks.vs_inductor`` (sequence 256, batch 2, vocabulary 2048), fitted
with ``optimize(..., budget_kind="peak", inner="inductor")`` at the given peak budget (26,259,464
bytes: torch.compile's measured peak at ``activation_memory_budget=0.05`` on HF Llama). Per candidate:
the fit's log line (asked, modelled, measured), the plan's recompute FLOPs, where the model peaks, the
backward step's working bytes and the largest storages alive there (K kept, R recomputed).
"""

from __future__ import annotations

import logging
import sys

import torch

from benchmarks.models import ModelSpec, build
from benchmarks.vs_inductor import remat_step
from remat_pass.runtime import inductor_fit, peak_fitting
from remat_pass.solvers.analysis.lifetimes import backward_steps_of
from remat_pass.solvers.analysis.memory import simulate_plan, storages_alive_at_peak

PLANS = []


def recording_fit(fit):
    def fit_recording(compile_at, inputs, **options):
        def recording(asked, seen):
            compiled, plan = compile_at(asked, seen)
            PLANS.append((asked, plan))
            return compiled, plan
        return fit(recording, inputs, **options)
    return fit_recording


def report(asked, plan) -> None:
    problem = plan.problem
    memory = simulate_plan(problem, plan)
    flops = sum(problem.values[v].flops for v in plan.recomputed) / 1e6
    print(f"\n=== asked {asked} modelled {plan.predicted_peak_bytes} kept {problem.bytes_of(plan.kept)} "
          f"recompute {flops:.1f} MFLOP, peak in {memory.peak_phase}")
    if memory.peak_phase != "backward":
        return
    step = memory.backward_event_steps[memory.peak_index]
    steps = backward_steps_of(problem)
    print(f"  backward step {step} of {len(steps)}: working {steps[step].working_bytes} bytes, "
          f"steps around it {[steps[i].working_bytes for i in range(max(0, step - 4), min(len(steps), step + 4))]}")
    members: dict[int, list[str]] = {}
    for value in problem.values:
        members.setdefault(value.storage, []).append(value.name)
    alive = sorted(storages_alive_at_peak(problem, plan, memory), key=lambda s: -problem.storage_bytes[s])
    for storage in alive[:6]:
        ids = [v.id for v in problem.values if v.storage == storage]
        how = "K" if any(i in plan.kept for i in ids) else "R" if any(i in plan.recomputed for i in ids) else "?"
        print(f"    {how} {problem.storage_bytes[storage]:>9} {members[storage][:3]}")
    print(f"    ... {len(alive)} storages, {sum(problem.storage_bytes[s] for s in alive)} bytes")


def main() -> None:
    kind, budget = sys.argv[1], int(sys.argv[2])
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("remat_pass.runtime.inductor_fit").setLevel(logging.INFO)
    peak_fitting.fit_peak = recording_fit(inductor_fit.fit_peak)
    torch.set_num_threads(1)
    work = build(ModelSpec(kind, layers=4, hidden=256, heads=4, seq=256, batch=2, vocab=2048))
    remat_step(work, budget, "inductor", None)
    for asked, plan in PLANS:
        report(asked, plan)


if __name__ == "__main__":
    main()
