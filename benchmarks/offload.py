"""Offload on or off: the predicted memory/time trade-off of a Llama-2-70B-shaped step at H100 numbers.

Run from the repository root::

    python -m benchmarks.offload --layers 4 --fractions 0.9,0.8,0.7,0.6,0.5,0.4,0.3
    python -m benchmarks.offload --help

A Hugging Face ``LlamaForCausalLM`` with Llama-2-70B's widths (hidden 8192, 64 heads, 8 KV heads,
intermediate 28672, vocab 32000, sequence 4096, batch 1, bf16; ``--layers`` of them) is built on
the meta device and traced as fake tensors (``benchmarks.scaling``), annotated with the ``--device``
cost model (roofline op times, the host link of ``remat_pass.annotate.costs``). For peak budgets at
``--fractions`` of the un-rematerialized step's simulated peak, it plans twice with the same peak
planner (``solvers.peak.planner``): caps solved by the keep/recompute ILP ("recompute only") and by the
keep/recompute/offload ILP ("with offload"). Everything is predicted: recompute time and exposed
transfer time from the models, peaks from the memory simulator, which counts sends in flight.

The headline compares with Beaumont, Eyraud-Dubois and Shilova (NeurIPS 2021), who report that
offloading removes about a third of rematerialization's overhead at equal memory:
``1 - extra(with offload) / extra(recompute only)`` at each budget.

Results: ``--out`` (default ``benchmarks/out/offload``) ``offload.json`` and ``offload.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.problem import Plan, Problem, format_bytes

from remat_pass import solvers

from .scaling import HFStep, llama_model, trace_timed

DEFAULT_OUT = Path("benchmarks/out/offload")


def _point(problem: Problem, budget: int, cap_solver: str, time_limit: float) -> dict[str, Any]:
    began = time.perf_counter()
    try:
        plan = solvers.solve(problem, budget, solver="ilp_peak", cap_solver=cap_solver, time_limit=time_limit)
    except solvers.BudgetInfeasibleError as error:
        return {"status": "infeasible", "lowest_peak_bytes": error.min_bytes, "seconds": time.perf_counter() - began}
    return _describe(problem, plan, time.perf_counter() - began)


def _describe(problem: Problem, plan: Plan, seconds: float) -> dict[str, Any]:
    return {
        "status": str(plan.status), "solver": plan.solver, "seconds": seconds,
        "peak_bytes": simulate_plan(problem, plan).peak_bytes, "kept_bytes": plan.kept_bytes,
        "offloaded_bytes": plan.offloaded_bytes, "recompute_seconds": plan.recompute_seconds,
        "exposed_seconds": plan.exposed_transfer_seconds, "extra_seconds": plan.predicted_extra_seconds,
        "recompute_flops": plan.recompute_flops,
    }


def step_seconds(problem: Problem) -> float:
    """Roofline time of the un-rematerialized step: every forward op and every backward op."""
    forward = sum(v.recompute_seconds for v in problem.values if not v.available)
    return forward + sum(step.seconds for step in problem.backward_steps)


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.llama_seq = args.seq
    model = llama_model(args.layers, args)
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    problem, capture_s, annotate_s, _ = trace_timed(HFStep(model), (ids,), args.device)
    keep_all = solvers.solve(problem, None, solver="keep_all")
    keep_all_peak = simulate_plan(problem, keep_all).peak_bytes
    step = step_seconds(problem)
    print(f"{args.layers} layers: {len(problem.values)} values, keep-all saves {format_bytes(problem.keep_all_bytes())}, "
          f"peaks at {format_bytes(keep_all_peak)}; step {step * 1e3:.1f} ms ({args.device} roofline); host link "
          f"{problem.host_bytes_per_second / 1e9:.0f} GB/s; traced in {capture_s + annotate_s:.1f}s", flush=True)
    rows = []
    for fraction in args.fractions:
        budget = int(fraction * keep_all_peak)
        recompute = _point(problem, budget, "ilp", args.time_limit)
        offload = _point(problem, budget, "ilp_offload", args.time_limit)
        row = {"fraction": fraction, "budget_bytes": budget, "recompute_only": recompute, "with_offload": offload}
        if "extra_seconds" in recompute and "extra_seconds" in offload and recompute["extra_seconds"] > 0:
            row["overhead_removed"] = 1 - offload["extra_seconds"] / recompute["extra_seconds"]
        rows.append(row)
        print(f"  peak <= {fraction:.2f}: recompute-only {_ms(recompute)}; with offload {_ms(offload)} "
              f"(offloaded {format_bytes(offload.get('offloaded_bytes', 0))}); "
              f"overhead removed {row.get('overhead_removed', float('nan')):.1%}", flush=True)
    return {"layers": args.layers, "seq": args.seq, "device": args.device, "values": len(problem.values),
            "host_bytes_per_second": problem.host_bytes_per_second, "keep_all_bytes": problem.keep_all_bytes(),
            "keep_all_peak_bytes": keep_all_peak, "step_seconds": step, "rows": rows}


def _ms(point: dict[str, Any]) -> str:
    if "extra_seconds" not in point:
        return f"infeasible (lowest peak {format_bytes(point['lowest_peak_bytes'])})"
    return (f"+{point['extra_seconds'] * 1e3:.1f} ms (recompute {point['recompute_seconds'] * 1e3:.1f}, "
            f"exposed {point['exposed_seconds'] * 1e3:.1f})")


def markdown(result: dict[str, Any], command: str) -> str:
    step = result["step_seconds"]
    lines = [
        f"`{command}`", "",
        (f"{result['layers']} Llama-2-70B-shaped layers (sequence {result['seq']}, batch 1, bf16), "
         f"{result['device']} cost model, host link {result['host_bytes_per_second'] / 1e9:.0f} GB/s per direction; "
         f"un-rematerialized: saves {format_bytes(result['keep_all_bytes'])}, peaks at "
         f"{format_bytes(result['keep_all_peak_bytes'])}, step {step * 1e3:.1f} ms (roofline)."), "",
        ("| peak budget | recompute only: extra ms (% of step) | with offload: extra ms (% of step) "
         "| recompute + exposed | offloaded | overhead removed |"),
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        r, o = row["recompute_only"], row["with_offload"]

        def cell(p: dict[str, Any]) -> str:
            if "extra_seconds" not in p:
                return "infeasible"
            return f"{p['extra_seconds'] * 1e3:.1f} ({p['extra_seconds'] / step:.1%})"

        split = (f"{o['recompute_seconds'] * 1e3:.1f} + {o['exposed_seconds'] * 1e3:.1f}"
                 if "extra_seconds" in o else "")
        removed = row.get("overhead_removed")
        lines.append(f"| {row['fraction']:.2f} ({format_bytes(row['budget_bytes'])}) | {cell(r)} | {cell(o)} | {split} "
                     f"| {format_bytes(o.get('offloaded_bytes', 0))} | "
                     f"{'n/a' if removed is None else f'{removed:.0%}'} |")
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="Llama-2-70B-shaped layers (default 4; the model has 80)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--fractions", type=_floats, default=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
                   help="peak budgets as fractions of the un-rematerialized step's peak")
    p.add_argument("--device", default="h100", help="cost model with a host link (a100, h100, h200)")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per planner call")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.offload " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run(args)
    meta = {"command": command, "torch": torch.__version__, "python": platform.python_version()}
    (args.out / "offload.json").write_text(json.dumps({**meta, **result}, indent=2))
    (args.out / "offload.md").write_text(markdown(result, command))
    print(f"wrote {args.out / 'offload.md'}")


if __name__ == "__main__":
    main()
