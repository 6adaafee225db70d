"""Kernel scratch on the device a CNN step runs on: what annotate measured, and whether the plan's
predicted peak then matches the allocator's, with and without the scratch counted.

    python -m benchmarks.scratch_check [--device cuda] [--fraction 0.6] [--out DIR]

The benchmark ResNet (CPU: 8 blocks, width 32, 32 px, batch 32; CUDA: width 64, 128 px, batch
64, as in the GPU preset), in fp32 and bf16. For each: the largest scratch annotate recorded
(``remat_pass.annotate.scratch``; measured on the device) and how long capture + annotate took; the
keep-all plan and a peak-budget plan at ``--fraction`` of keep-all's predicted peak, each with its
predicted peak against the measured activation peak (``measure.allocator_peak``, parameter
gradients left out; on CUDA ``max_memory_allocated`` less the gradients beside it); then the same
budget planned with the scratch left out of the Problem. One JSON line per result, also appended
to ``DIR/scratch_check.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

import remat_pass
import remat_pass.annotate.annotate as annotate_module
from remat_pass.runtime import measure
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture

from .models import ModelSpec, build


def _measured(step: Callable[[], None], params: list[nn.Parameter], device: torch.device) -> dict[str, Any]:
    step()
    for p in params:
        p.grad = None
    peak = measure.allocator_peak(step, device, survivors=lambda: [p.grad for p in params]).peak_excluding
    found: dict[str, Any] = {"measured": peak}
    if device.type == "cuda":
        for p in params:
            p.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        grads = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
        found["max_allocated_less_grads"] = torch.cuda.max_memory_allocated(device) - base - grads
    for p in params:
        p.grad = None
    return found


def _scratch_rows(graph: torch.fx.Graph, limit: int = 10) -> list[tuple[float, str, str]]:
    rows = set()
    for node in graph.nodes:
        nbytes = getattr(node.meta.get("remat"), "scratch_bytes", 0)
        if nbytes:
            shapes = [tuple(a.meta["val"].shape) for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            rows.add((round(nbytes / 2**20, 3), str(node.target), str(shapes[:3])))
    return sorted(rows, reverse=True)[:limit]


def check(device: torch.device, dtype: torch.dtype, fraction: float, emit: Callable[[dict[str, Any]], None]) -> None:
    spec = (ModelSpec("resnet", layers=8, hidden=64, seq=128, batch=64) if device.type == "cuda"
            else ModelSpec("resnet", layers=8, hidden=32, seq=32, batch=32))
    work = build(spec, device=str(device), dtype=dtype)
    model, inputs, params = work.model, tuple(work.inputs), list(work.model.parameters())
    tag = {"model": spec.label, "dtype": str(dtype).removeprefix("torch.")}
    began = time.perf_counter()
    (joint,) = capture(model, inputs)
    annotate(joint)
    emit({**tag, "capture_annotate_s": round(time.perf_counter() - began, 2), "scratch_MiB": _scratch_rows(joint.module.graph)})

    def run(budget: object, **options: Any) -> tuple[remat_pass.Plan, dict[str, Any]]:
        torch._dynamo.reset()
        optimized = remat_pass.optimize(model, budget=budget, example_inputs=inputs, plan_cache=None, **options)
        step = lambda: F.cross_entropy(optimized(*inputs).float(), work.target).backward()  # noqa: E731
        return optimized.plan, _measured(step, params, device)

    plan, found = run(1.0)
    emit({**tag, "plan": "keep_all", "predicted": plan.predicted_peak_bytes, **found})
    budget = int(fraction * plan.predicted_peak_bytes)
    real = annotate_module.kernel_scratch
    for counted in (True, False):
        annotate_module.kernel_scratch = real if counted else (lambda graph, uncounted=(), **_: {})
        try:
            plan, found = run(budget, budget_kind="peak", time_limit=20)
            emit({**tag, "plan": f"peak@{fraction}", "scratch_counted": counted, "budget": budget,
                  "predicted": plan.predicted_peak_bytes, **found, "within_budget": found["measured"] <= budget})
        except remat_pass.BudgetInfeasibleError as error:
            emit({**tag, "plan": f"peak@{fraction}", "scratch_counted": counted, "error": str(error)[:300]})
        finally:
            annotate_module.kernel_scratch = real


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--dtype", action="append", choices=["fp32", "bf16"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/scratch_check"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        torch.set_num_threads(1)  # as the CPU preset: the allocator's profile is per thread

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)
        with (args.out / "scratch_check.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    for name in args.dtype or ["fp32", "bf16"]:
        check(torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[name], args.fraction, emit)


if __name__ == "__main__":
    main()
