"""How far the peak planner's plans are from the optimum of its own peak model, and what is proven.

Issue 13 asks for plan quality within 5% of the exact optimum of remat_pass's peak model
wherever that optimum can be had within 10 minutes on small models, and the gap printed where it
cannot. For each model (random init, loss inside the step, recompute priced by FLOPs, the
deterministic yardstick on a shared CPU), with the budget at per-block checkpointing's simulated
peak (``per_block``, which saves what ``torch.utils.checkpoint`` saves):

* ``default``: ``ilp_peak`` as a user gets it (``--time-limit``, 60 s);
* ``long``: ``ilp_peak`` with ``--long-time-limit`` (600 s) and every spare second for the exact
  rows (``exact_share=1``): its best plan and its proven lower bound.

``--budget-bytes`` replaces per-block's peak with another budget (costs are still reported over
per-block's recompute cost).

"any schedule" is ``solvers.peak.schedule_bound``'s lower bound (rows at ``--schedule-steps``
backward steps, 48 by default, 0 for all): no schedule, multiple recomputation included, recomputes less. The
distance between it and the proven optimum is the most that recomputing a value more than once
could still gain over remat_pass's peak model.

Costs are reported over per-block checkpointing's recompute cost; "proven" is the best lower
bound either run proved. The default plan is within ``default / proven - 1`` of the optimum
(an upper bound on its distance), and within ``default / best - 1`` of the best plan known.
Planning times are wall-clock on whatever machine runs it (not comparable across loads).

    python -m benchmarks.peak_optimality --out benchmarks/out/peak_optimality
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from remat_pass.planning.pipeline import trace_step
from remat_pass.solvers import baselines
from remat_pass.solvers.mip.solve import backend_works
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.peak.planner import solve_peak
from remat_pass.solvers.problem import Plan, Problem
from remat_pass.solvers.peak.schedule_bound import DEFAULT_STEPS, any_schedule_bound

from .models import HF_FAMILY_KINDS, ModelSpec, build

logger = logging.getLogger("benchmarks.peak_optimality")

KINDS = ("gpt", "llama", "hf_gpt2", "hf_llama", "hf_bert")


def traced_problem(spec: ModelSpec) -> Problem:
    """The spec's training step (loss included), recompute priced by FLOPs on the CPU."""
    workload = build(spec)
    target = workload.target

    def loss_fn(output: torch.Tensor, *_inputs: Any) -> torch.Tensor:
        return workload.loss_fn(output, target)

    torch._dynamo.reset()
    return trace_step(workload.model, workload.inputs, loss_fn=loss_fn, device="cpu", costs="flops").problem


def _run(problem: Problem, budget: int, time_limit: float, exact_share: float | None) -> dict[str, Any]:
    began = time.perf_counter()
    options = {} if exact_share is None else {"exact_share": exact_share}
    plan = solve_peak(problem, budget, time_limit=time_limit, **options)
    seconds = time.perf_counter() - began
    cost = plan.recompute_seconds
    bound = cost if str(plan.status) == "optimal" else (None if plan.gap is None else cost * (1 - plan.gap))
    return {"cost": cost, "bound": bound, "status": str(plan.status), "gap": plan.gap,
            "peak_bytes": plan.predicted_peak_bytes, "plan_seconds": round(seconds, 1)}


def _any_schedule(problem: Problem, budget: int, steps: int, time_limit: float) -> dict[str, Any]:
    backend = "cpsat" if backend_works("cpsat") else "highs"
    began = time.perf_counter()
    found = any_schedule_bound(problem, budget, backend=backend, time_limit=time_limit,
                               steps=steps or len(problem.backward_steps))
    return {"bound": found.seconds, "status": found.status, "steps": found.steps, "backend": backend,
            "seconds": round(time.perf_counter() - began, 1)}


def measure(spec: ModelSpec, time_limit: float, long_time_limit: float, budget: int | None = None,
            schedule_steps: int = DEFAULT_STEPS) -> dict[str, Any]:
    problem = traced_problem(spec)
    per_block = baselines.per_block(problem)
    reference = Plan(problem, per_block.kept, per_block.recomputed, "per_block")
    budget = simulate_plan(problem, reference).peak_bytes if budget is None else budget
    scale = reference.recompute_seconds
    default = _run(problem, budget, time_limit, None)
    long = _run(problem, budget, long_time_limit, 1.0)
    best = min(default["cost"], long["cost"])
    proven = max((b for b in (default["bound"], long["bound"]) if b is not None), default=None)
    row = {
        "model": spec.label, "values": len(problem.values), "backward_steps": len(problem.backward_steps),
        "budget_bytes": budget, "per_block_cost": scale,
        "default": default, "long": long,
        "default_over_per_block": default["cost"] / scale, "best_over_per_block": best / scale,
        "proven_over_per_block": None if proven is None else proven / scale,
        "default_over_best": default["cost"] / best - 1,
        "default_over_proven": None if not proven else default["cost"] / proven - 1,
        "optimum_proven": proven is not None and best <= proven * (1 + 1e-6),
        "any_schedule": _any_schedule(problem, budget, schedule_steps, long_time_limit),
    }
    any_bound = row["any_schedule"]["bound"]
    row["any_schedule_over_per_block"] = None if any_bound is None else any_bound / scale
    for key in ("default", "long"):
        assert row[key]["peak_bytes"] <= budget, (spec.label, key)
    return row


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | default: cost / per-block (status, plan s) | long: cost / per-block (plan s) | proven bound "
             "/ per-block | default vs best known | default vs proven bound | any schedule ≥ (steps, s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        proven = "none" if r["proven_over_per_block"] is None else f"{r['proven_over_per_block']:.3f}"
        # float noise around 0 would print "-0.0%"; a real negative (a plan below a proven bound: a
        # bug) still shows
        over = r["default_over_proven"]
        versus = "n/a" if over is None else f"{100 * (0.0 if abs(over) < 1e-9 else over):+.1f}%"
        mark = " (optimal)" if r["optimum_proven"] else ""
        lines.append(
            f"| {r['model']} | {r['default_over_per_block']:.3f} ({r['default']['status']}, "
            f"{r['default']['plan_seconds']:.0f} s) | {r['long']['cost'] / r['per_block_cost']:.3f} "
            f"({r['long']['plan_seconds']:.0f} s) | {proven}{mark} | +{100 * r['default_over_best']:.1f}% | {versus} | "
            f"{_any(r)} |")
    return "\n".join(lines)


def _any(row: dict[str, Any]) -> str:
    found, over = row["any_schedule"], row["any_schedule_over_per_block"]
    return f"{'none' if over is None else f'{over:.3f}'} ({found['steps']}, {found['seconds']:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=(*KINDS, *HF_FAMILY_KINDS),
                        help=f"repeatable (default: {', '.join(KINDS)})")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--time-limit", type=float, default=60.0, help="the default run's limit (s)")
    parser.add_argument("--long-time-limit", type=float, default=600.0, help="the long run's limit (s)")
    parser.add_argument("--budget-bytes", type=int, help="this peak budget instead of per-block's simulated peak")
    parser.add_argument("--schedule-steps", type=int, default=DEFAULT_STEPS,
                        help="backward steps with rows in the any-schedule bound (0: all; all of them proved no "
                             "bound on the Llama-style models in 85 s, 48 prove one in seconds)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/peak_optimality"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    rows = []
    for kind in args.model or KINDS:
        spec = ModelSpec(kind, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                         batch=args.batch, vocab=args.vocab)
        rows.append(measure(spec, args.time_limit, args.long_time_limit, args.budget_bytes, args.schedule_steps))
        logger.info("%s", json.dumps(rows[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    logger.info("\n%s", render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
