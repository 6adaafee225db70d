"""GPU check of offload (prepared for a session with a CUDA device; not run on the CPU).

    python -m benchmarks.gpu_offload_check [--device-profile h200] [--fraction 0.5] [--out DIR]

On one CUDA device, a GPT-style model (fp32, no dropout, so that every run does the same
arithmetic) takes one training step four ways: eager without remat (the reference), remat_pass
recompute-only and remat_pass with ``offload=True`` at the same peak budget (``--fraction`` of the
no-remat step's measured activation peak), and offload with its plan's predicted peak. For each:
the loss and gradients against the reference (bit for bit), the activation peak (the allocator's
history, parameter gradients left out, as budgets mean it; ``max_memory_allocated`` beside it), the median step time over ``--steps`` steps, and
for offload the bytes the profiler saw cross the host link (Memcpy DtoH / HtoD) against the
plan's ``2 * offloaded_bytes``. Offload needs torch with ``torch.ops.ao.offload`` (2.13+): on an
older torch the error remat_pass raises is recorded and only the recompute-only run is made. Prints one JSON document, also written to
``DIR/gpu_offload_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat_pass
from remat_pass.examples import GPT, GPTConfig, lm_loss
from remat_pass.runtime.measure import allocator_peak
from remat_pass.rewrite.offload import ao_ops_available


class _Step(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.gpt(tokens), targets)


def _one_step(model: nn.Module, call: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    loss = call(*inputs)
    loss.backward()
    torch.cuda.synchronize()
    return {"loss": loss.detach(), "seconds": time.perf_counter() - began,
            "peak_bytes": torch.cuda.max_memory_allocated() - base,
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _measure(model: nn.Module, call: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
             steps: int) -> dict[str, Any]:
    first = _one_step(model, call, inputs)  # compiles and plans
    runs = [_one_step(model, call, inputs) for _ in range(steps)]
    for p in model.parameters():
        p.grad = None
    # The activation peak, as remat_pass's budgets mean it: the parameter gradients left out.
    activations = allocator_peak(lambda: call(*inputs).backward(), "cuda", lambda: [p.grad for p in model.parameters()])
    return {"first": first, "seconds": statistics.median(r["seconds"] for r in runs),
            "peak_bytes": activations.peak_excluding,
            "max_memory_allocated": max(r["peak_bytes"] for r in runs), "last": runs[-1]}


def _same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    differing = [n for n in b["grads"] if not torch.equal(a["grads"][n], b["grads"][n])]
    return {"loss_equal": bool(torch.equal(a["loss"], b["loss"])), "grads_equal": not differing,
            "differing": differing[:5]}


def _pinned_pool() -> Any:
    from torch._functorch._activation_offloading.offload_ops import pinned_memory_pool

    return pinned_memory_pool()


def _link_bytes(call: Callable[[], Any]) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    totals = {"DtoH": 0, "HtoD": 0}
    for event in prof.events():
        name = event.name
        for direction in totals:
            if "Memcpy" in name and direction in name:
                totals[direction] += int(getattr(event, "nbytes", 0) or 0)
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_offload_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device-profile", default="h200")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/out/gpu")))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this check runs on a GPU machine", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                              "ao_ops": ao_ops_available(), "args": {k: str(v) for k, v in vars(args).items()}}
    from remat_pass.rewrite.offload import OffloadUnavailableError, transfer_ops

    variants: list[tuple[str, dict[str, Any]]] = [("recompute_only", {})]
    try:
        report["transfer_ops"] = transfer_ops(torch.device("cuda")).kind
        variants.append(("offload", {"offload": True}))
    except OffloadUnavailableError as error:  # torch without the ops: the clear error; recompute-only still runs
        report["transfer_ops"] = f"unavailable: {error}"

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=4096, seq_len=args.seq, layers=args.layers, hidden=args.hidden,
                       heads=args.hidden // 64, dropout=0.0)
    reference_model = _Step(config).cuda()
    inputs = (torch.randint(0, 4096, (args.batch, args.seq), device="cuda"),
              torch.randint(0, 4096, (args.batch, args.seq), device="cuda"))
    eager = _measure(reference_model, reference_model, inputs, args.steps)
    budget = int(args.fraction * eager["peak_bytes"])
    report["eager"] = {"seconds": eager["seconds"], "peak_bytes": eager["peak_bytes"],
                       "max_memory_allocated": eager["max_memory_allocated"]}
    report["budget_bytes"] = budget

    for name, options in variants:
        model = copy.deepcopy(reference_model)
        optimized = remat_pass.optimize(model, budget=budget, device=args.device_profile, plan_cache=None, **options)
        with _pinned_pool() if options else contextlib.nullcontext():
            result = _measure(model, optimized, inputs, args.steps)
            link = _link_bytes(lambda step=optimized: step(*inputs).backward()) if options else {}
        plan = optimized.plan
        report[name] = {
            "seconds": result["seconds"], "peak_bytes": result["peak_bytes"], "within_budget": result["peak_bytes"] <= budget,
            "max_memory_allocated": result["max_memory_allocated"],
            "predicted_peak_bytes": plan.predicted_peak_bytes, "recompute_seconds": plan.recompute_seconds,
            "offloaded_bytes": plan.offloaded_bytes, "exposed_transfer_seconds": plan.exposed_transfer_seconds,
            "link_bytes_measured": link, "link_bytes_predicted": 2 * plan.offloaded_bytes,
            "vs_eager": _same(result["last"], eager["last"]), "solver": plan.solver,
        }
    print(json.dumps(report, indent=2, default=str))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_offload_check.json").write_text(json.dumps(report, indent=2, default=str))
    ok = all(report[name]["vs_eager"]["grads_equal"] for name, _ in variants)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
