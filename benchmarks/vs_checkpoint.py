"""remat_pass against Hugging Face's per-layer checkpointing at the memory that checkpointing reaches.

Held-out Hugging Face models (GPT-2 with eager attention, Llama, BERT; random weights, no
dropout so that every gradient is comparable), the loss inside the module, one training step:

* ``none``: eager, nothing checkpointed;
* ``checkpoint``: ``activation_checkpointing_enable`` (``torch.utils.checkpoint`` around every
  layer, non-reentrant);
* ``per_block``: remat_pass's own per-block baseline through its rewrite;
* ``peak@checkpoint``: remat_pass with a peak budget equal to ``checkpoint``'s *measured* peak.

``--any-schedule-seconds S`` adds, to the ``peak@checkpoint`` row, a proven lower bound on the
FLOPs that *any* recompute schedule fitting that budget recomputes (``solvers.peak.schedule_bound``,
multiple recomputation included; the step priced by FLOPs alone, CP-SAT for ``S`` seconds):
the floor no recompute-only planner can go under, to read the row's FLOPs against.

Peaks are allocator-level (``remat_pass.runtime.measure.peak_activation_bytes``), FLOPs are the matmul/attention
FLOPs executed (``FlopCounterMode`` for the eager rows, the profiler for remat's runtime), the
gradients are compared with eager's. ``python -m benchmarks.vs_checkpoint --out DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat_pass
from remat_pass.runtime.measure import peak_activation_bytes
from remat_pass.solvers.mip.solve import backend_works
from remat_pass.solvers.problem import Problem
from remat_pass.solvers.peak.schedule_bound import any_schedule_bound

from .metrics import dispatch_flops, executed_flops
from .hf_families import FAMILIES
from .models import LossOf, hf_model


def measured_step(module: nn.Module, model: LossOf, tokens: torch.Tensor) -> dict[str, Any]:
    """One training step through ``module``: the allocator's activation peak ("peak_bytes") and
    ``model``'s gradients ("grads"), which are cleared again."""
    model.zero_grad(set_to_none=True)
    _, peak = peak_activation_bytes(lambda: module(tokens).backward(), lambda: [p.grad for p in model.parameters()])
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return {"peak_bytes": peak, "grads": grads}


def any_schedule_flops(problem: Problem, budget_bytes: int, seconds: float) -> int | None:
    """A proven lower bound on the FLOPs any recompute schedule that fits ``budget_bytes``
    recomputes: ``schedule_bound`` on the step priced by FLOPs alone (None: nothing proven)."""
    by_flops = dataclasses.replace(problem, values=tuple(
        dataclasses.replace(value, recompute_seconds=value.flops * 1e-12) for value in problem.values))
    backend = "cpsat" if backend_works("cpsat") else "highs"
    found = any_schedule_bound(by_flops, budget_bytes, backend=backend, time_limit=seconds)
    if found.seconds is None:
        return None
    return math.floor(found.seconds * 1e12 * (1 - 1e-9))  # float noise must not lift the bound


def run_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    model = LossOf(hf_model(name, args.layers, args.hidden, args.seq, args.vocab),
                   torch.randint(0, args.vocab, (args.batch, args.seq))).train()
    rows = []
    base = measured_step(model, model, tokens)
    base_flops = dispatch_flops(lambda: model(tokens).backward())
    rows.append({"strategy": "none", "peak_bytes": base["peak_bytes"], "flops": base_flops})
    inner = model.model
    inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ckpt = measured_step(model, model, tokens)
    rows.append({"strategy": "checkpoint", "peak_bytes": ckpt["peak_bytes"],
                 "flops": dispatch_flops(lambda: model(tokens).backward())})
    inner.activation_checkpointing_disable()
    for label, options in (("per_block", {"budget": 1.0, "solver": "per_block"}),
                           ("peak@checkpoint", {"budget": ckpt["peak_bytes"], "budget_kind": "peak",
                                                "solver": "ilp_peak", "time_limit": args.plan_time_limit,
                                                "costs": args.costs})):
        torch._dynamo.reset()
        began = time.perf_counter()
        try:
            optimized = remat_pass.optimize(model, example_inputs=(tokens,), plan_cache=None, **options)  # timed: no cache
        except remat_pass.BudgetInfeasibleError as error:
            rows.append({"strategy": label, "failed": str(error)})
            continue
        plan_seconds = time.perf_counter() - began
        measured = measured_step(optimized, model, tokens)
        flops = executed_flops(lambda: optimized(tokens).backward()).total
        model.zero_grad(set_to_none=True)
        diff = max((a - b).abs().max().item() for a, b in zip(measured["grads"], base["grads"]))
        plan = optimized.plan
        rows.append({"strategy": label, "peak_bytes": measured["peak_bytes"], "flops": flops,
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "budget_bytes": plan.budget_bytes,
                     "status": str(plan.status), "gap": plan.gap, "solver": plan.solver,
                     "plan_seconds": plan_seconds, "grad_max_abs_diff": diff})
        if label == "peak@checkpoint" and args.any_schedule_seconds > 0:
            rows[-1]["any_schedule_flops"] = any_schedule_flops(plan.problem, plan.budget_bytes,
                                                                args.any_schedule_seconds)
    ckpt_extra = rows[1]["flops"] - base_flops
    for row in rows:
        row["model"] = name
        if "flops" in row:
            row["flop_overhead"] = row["flops"] / base_flops - 1
            row["over_checkpoint"] = (row["flops"] - base_flops) / ckpt_extra if ckpt_extra else None
        if row.get("any_schedule_flops") is not None and ckpt_extra:
            row["any_schedule_over_checkpoint"] = row["any_schedule_flops"] / ckpt_extra
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=("gpt2", "llama", "bert", *FAMILIES),
                        help="repeatable (default: gpt2, llama, bert)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--plan-time-limit", type=float, default=60.0)
    parser.add_argument("--costs", default="roofline",
                        help="how remat_pass prices recompute (optimize's costs=): roofline (default), flops "
                        "(recomputed FLOPs alone, the deterministic yardstick here) or measure")
    parser.add_argument("--any-schedule-seconds", type=float, default=0.0,
                        help="CP-SAT seconds (building its model included) for the any-schedule lower bound at checkpointing's peak "
                             "(0: skip)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/vs_checkpoint"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for name in args.model or ("gpt2", "llama", "bert") for row in run_model(name, args)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
