"""What the default planning effort costs and gives (issue 31; ``benchmarks/SCALING.md``, "Two seconds by default").

    python -m benchmarks.planning_time --solver-limits 2,5           # the peak planner alone at each limit
    python -m benchmarks.planning_time --first-step inductor         # torch.compile's first step, plain Inductor
    python -m benchmarks.planning_time --first-step remat            # ... with remat_pass's backend (Inductor, fitted)
    python -m benchmarks.planning_time --first-step whole            # aot_eager, no remat_pass: the step whole
    python -m benchmarks.planning_time --first-step regional         # ... each block a nested_compile_region
    python -m benchmarks.planning_time --restart remat               # a job started twice: cold, then warm caches
    python -m benchmarks.planning_time --restart optimize            # ... with optimize(..., inner="inductor")
    python -m benchmarks.planning_time --restart optimize --precompile  # ... with torch's TORCH_CACHING_PRECOMPILE=1
    python -m benchmarks.planning_time --restart optimize-eager --precompile  # ... optimize's default, inner="eager"
    python -m benchmarks.planning_time --restart optimize-eager --bundled-aot-cache  # ... AOTAutograd's cache bundling graphs

``--solver-limits``: the problems are traced once (the first-call 12-layer HF GPT-2 on real tensors at
its checkpointing peak; the scaling GPT at 12 and 48 layers and three small HF models on meta tensors,
at per-block checkpointing's simulated peak, halfway to keep-all's, and 0.85 of per-block's), then
``ilp_peak`` without proof work solves each at every limit, with no search before a refusal, and at
the default effort (``effort.effort_options``: 2 s, then on to 10 s before a refusal).
``--first-step``: a new process per run; the Inductor runs get a fresh ``TORCHINDUCTOR_CACHE_DIR``.
``--restart inductor|remat|optimize|optimize-eager``: ``--first-step`` in two new processes, one after the other, sharing
one fresh ``TORCHINDUCTOR_CACHE_DIR`` and (remat) one fresh plan cache: the second process's first
step is what restarting a job costs, its compiles answered by Inductor's caches where they can be
(``remat_pass.capture.inductor_compile``). ``--precompile`` sets torch's ``TORCH_CACHING_PRECOMPILE=1`` in both
processes and the first saves ``torch.compiler.save_cache_artifacts()`` after its steps: the second then
runs Dynamo's and Inductor's saved work without tracing (``remat_pass.capture.precompiled``; the eager inner
compiler's graphs are saved as graphs: ``remat_pass.capture.eager_compile``). ``--bundled-aot-cache`` sets
``torch._functorch.config.bundled_autograd_cache`` in both processes instead: AOTAutograd's cache then stores the
eager compiler's graphs too, and the restart traces with Dynamo but plans and rewrites nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from remat_pass import solvers
from remat_pass.planning.effort import FAST_TIME_LIMIT, effort_options

from .models import LossOf, hf_model
from .scaling import first_call_model, gpt_problem, parser as scaling_parser, trace_timed


def baseline_peak(problem: solvers.Problem, solver: str) -> int:
    return solvers.simulate_plan(problem, solvers.solve(problem, None, solver=solver)).peak_bytes


def hf_problem(name: str, layers: int, hidden: int, seq: int, batch: int) -> solvers.Problem:
    with torch.device("meta"):
        model = LossOf(hf_model(name, layers, hidden, seq, 8192, heads=hidden // 64),
                       torch.zeros(batch, seq, dtype=torch.long)).train()
    return trace_timed(model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),), "h100")[0]


def problems() -> list[tuple[str, solvers.Problem, int]]:
    """(label, problem, peak budget in bytes) for every case of ``--solver-limits``."""
    from remat_pass.planning.pipeline import without_headroom

    model, tokens, budget = first_call_model()
    gpt2 = trace_timed(model, (tokens,), "cpu")[0]
    cases = [("HF GPT-2 12 layers (first call), checkpointing's peak", gpt2, without_headroom(budget))]
    args = scaling_parser().parse_args([])
    for layers in (12, 48):
        problem = gpt_problem(args, layers)[0]
        cases.append((f"scaling GPT {layers} layers, pb", problem, baseline_peak(problem, "per_block")))
    for name, shape in (("llama", (8, 512, 512, 1)), ("bert", (6, 512, 512, 2)), ("gpt2", (6, 384, 256, 2))):
        problem = hf_problem(name, *shape)
        per_block, keep_all = baseline_peak(problem, "per_block"), baseline_peak(problem, "keep_all")
        for label, budget in (("pb", per_block), ("mid", (per_block + keep_all) // 2), ("0.85 pb", int(0.85 * per_block))):
            cases.append((f"HF {name} {shape[0]} layers h{shape[1]}, {label}", problem, budget))
    return cases


def _solve(problem: solvers.Problem, budget: int, **options: Any) -> str:
    began = time.perf_counter()
    try:
        plan = solvers.solve(problem, budget, solver="ilp_peak", **options)
    except solvers.BudgetInfeasibleError:
        return f"refused ({time.perf_counter() - began:.1f} s)"
    return f"{plan.recompute_seconds:.6g} s ({time.perf_counter() - began:.1f} s)"


def solver_limits(limits: list[float]) -> None:
    print("| problem, budget | " + " | ".join(f"{limit:g} s" for limit in limits) + " | default effort |")
    print("|---|" + "---|" * (len(limits) + 1))
    default = effort_options("ilp_peak", FAST_TIME_LIMIT, False)
    for label, problem, budget in problems():
        cells = [_solve(problem, budget, time_limit=limit, prove=False) for limit in limits]
        cells.append(_solve(problem, budget, **default))
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def first_step(which: str, plan_cache: str | bool = False, bundled: bool = False) -> None:
    """One first training step under torch.compile, timed; then a second. ``plan_cache``: remat's;
    ``bundled``: AOTAutograd's cache bundles the compiled graphs (``bundled_autograd_cache``)."""
    import remat_pass
    from torch._dynamo.utils import counters

    torch._functorch.config.bundled_autograd_cache = bundled
    model, tokens, budget = first_call_model()
    if which in ("whole", "regional"):
        with torch.no_grad():
            model(tokens)  # Hugging Face's first-call hooks, outside the timing
        if which == "regional":
            import transformers.models.gpt2.modeling_gpt2 as gpt2

            gpt2.GPT2Block.forward = torch.compiler.nested_compile_region(gpt2.GPT2Block.forward)
        backend: Any = "aot_eager"
    elif which == "inductor":
        backend = "inductor"
    elif which == "remat":
        backend = remat_pass.backend(budget=budget, budget_kind="peak", plan_cache=plan_cache)
    torch._dynamo.reset()
    if which == "optimize":  # remat_pass.optimize with Inductor as its inner compiler
        compiled = remat_pass.optimize(model, budget=budget, budget_kind="peak", inner="inductor",
                                       plan_cache=plan_cache)
    elif which == "optimize-eager":  # remat_pass.optimize as a user calls it: its default inner compiler, eager
        compiled = remat_pass.optimize(model, budget=budget, budget_kind="peak", plan_cache=plan_cache)
    else:
        compiled = torch.compile(model, backend=backend)
    for step in ("first", "second"):
        began = time.perf_counter()
        loss = compiled(tokens)
        forward = time.perf_counter() - began
        loss.backward()
        print(f"{which}: {step} step {time.perf_counter() - began:.2f} s (forward, with its compile, {forward:.2f} s; "
              f"peak budget {budget} for remat; AOTAutograd cache {dict(counters['aot_autograd'])})", flush=True)
    if which in ("remat", "optimize", "optimize-eager"):  # the budget is a promise: the step's peak measured, compiled anew or not
        from remat_pass.runtime.measure import peak_activation_bytes

        grads = [p for p in model.parameters() if p.requires_grad]
        for parameter in grads:
            parameter.grad = None  # the step's gradients are then the survivors, not temporaries added into .grad
        _, peak = peak_activation_bytes(lambda: compiled(tokens).backward(), survivors=lambda: [p.grad for p in grads])
        print(f"{which}: a third step's activation peak {peak} bytes, {peak / budget:.3f} of the budget", flush=True)
    if torch._dynamo.config.caching_precompile:  # TORCH_CACHING_PRECOMPILE=1: the job saves at its end
        began = time.perf_counter()
        torch.compiler.save_cache_artifacts()
        print(f"{which}: saved torch's precompile artifacts in {time.perf_counter() - began:.2f} s; Dynamo cache "
              f"{dict(counters['dynamo_cache'])}", flush=True)


def restart(which: str, precompile: bool = False, bundled: bool = False) -> None:
    """``first_step`` in a new process with cold caches, then in another with the caches it left;
    ``precompile``: with torch's ``TORCH_CACHING_PRECOMPILE=1``, the first process saving its artifacts;
    ``bundled``: both with AOTAutograd's cache bundling the compiled graphs."""
    caches = tempfile.mkdtemp(prefix="restart_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
    if precompile:
        env["TORCH_CACHING_PRECOMPILE"] = "1"
    for run in ("cold caches", "warm caches"):
        print(f"-- a new process, {run}", flush=True)
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.planning_time", "--first-step", which,
                        "--plan-cache", os.path.join(caches, "plans"), *(["--bundled-aot-cache"] if bundled else [])],
                       env=env, check=True)
        print(f"   (the process, imports and model included: {time.perf_counter() - began:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planning_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--solver-limits", type=lambda text: [float(x) for x in text.split(",")], default=None)
    p.add_argument("--first-step", choices=("inductor", "remat", "optimize", "optimize-eager", "whole", "regional"),
                   default=None)
    p.add_argument("--plan-cache", default=None, help="remat's plan cache for --first-step (default: none)")
    p.add_argument("--restart", choices=("inductor", "remat", "optimize", "optimize-eager"), default=None)
    p.add_argument("--precompile", action="store_true",
                   help="--restart with torch's TORCH_CACHING_PRECOMPILE=1 (Dynamo's work saved too)")
    p.add_argument("--bundled-aot-cache", action="store_true",
                   help="with torch._functorch.config.bundled_autograd_cache (the eager compiler's graphs cached too)")
    args = p.parse_args(argv)
    if args.restart:
        restart(args.restart, args.precompile, args.bundled_aot_cache)
        return
    if args.first_step in ("inductor", "remat", "optimize", "optimize-eager"):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_"))  # cold, as a new machine
    if args.solver_limits:
        solver_limits(args.solver_limits)
    if args.first_step:
        first_step(args.first_step, args.plan_cache or False, args.bundled_aot_cache)


if __name__ == "__main__":
    main()
